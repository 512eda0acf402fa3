#include "cpu_kernels.h"

/* Causal softmax attention without a gradient (docs/kernels.md §2; readable twin: components.Attention's explicit
 * path). q, k, v and the output z are [B, P, H, Dh] contiguous (the model's layout, no transposes); per batch
 * row b, head h and query t, over keys j <= t:
 *   s_j = q_t . (scale k_j),   z_t = sum_j e^{s_j - m} v_j / sum_j e^{s_j - m},   m = max_j s_j
 * Each (b, h) copies its keys, scaled and transposed, into a [Dh, P'] block (P' = P rounded up to KEY_CHUNK) that
 * stays in L1/L2 while every query reads it: a query's scores are then Dh broadcast FMAs per KEY_CHUNK keys, with
 * independent accumulators, where PyTorch's flash kernel for the CPU works in blocks sized for long heads (slower
 * on the model's short heads; longer heads go to it, docs/kernels.md §2). Keys past t in
 * the last chunk get -inf, weight 0 (the float build's exp, exp_nonpositive, gives 0 there). (b, h) pairs are
 * split over threads; returns 0, or -1 when a thread's block could not be allocated (the output is incomplete). */
#define KEY_CHUNK 16

INLINE void attention_scores(const real *qt, const real *kt, int64_t Tp, int64_t Dh, int64_t np, real *s) {
#if VECTOR_SUMS
    int64_t j0 = 0;
    for (; j0 + 32 <= np; j0 += 32) { /* two d per step: eight chains, so the FMAs' latency overlaps */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t d = 0;
        for (; d + 2 <= Dh; d += 2) {
            const __m256 q0 = _mm256_set1_ps(qt[d]), q1 = _mm256_set1_ps(qt[d + 1]);
            const real *kd = kt + d * Tp + j0;
            a0 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd), a0);
            a1 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd + 8), a1);
            a2 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd + 16), a2);
            a3 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd + 24), a3);
            b0 = _mm256_fmadd_ps(q1, _mm256_load_ps(kd + Tp), b0);
            b1 = _mm256_fmadd_ps(q1, _mm256_load_ps(kd + Tp + 8), b1);
            b2 = _mm256_fmadd_ps(q1, _mm256_load_ps(kd + Tp + 16), b2);
            b3 = _mm256_fmadd_ps(q1, _mm256_load_ps(kd + Tp + 24), b3);
        }
        for (; d < Dh; ++d) {
            const __m256 q0 = _mm256_set1_ps(qt[d]);
            const real *kd = kt + d * Tp + j0;
            a0 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd), a0);
            a1 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd + 8), a1);
            a2 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd + 16), a2);
            a3 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd + 24), a3);
        }
        _mm256_store_ps(s + j0, _mm256_add_ps(a0, b0));
        _mm256_store_ps(s + j0 + 8, _mm256_add_ps(a1, b1));
        _mm256_store_ps(s + j0 + 16, _mm256_add_ps(a2, b2));
        _mm256_store_ps(s + j0 + 24, _mm256_add_ps(a3, b3));
    }
    if (j0 < np) { /* one chunk of 16 left */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        int64_t d = 0;
        for (; d + 2 <= Dh; d += 2) { /* two d per step: four chains instead of two */
            const real *kd = kt + d * Tp + j0;
            const __m256 q0 = _mm256_set1_ps(qt[d]), q1 = _mm256_set1_ps(qt[d + 1]);
            a0 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd), a0);
            a1 = _mm256_fmadd_ps(q0, _mm256_load_ps(kd + 8), a1);
            b0 = _mm256_fmadd_ps(q1, _mm256_load_ps(kd + Tp), b0);
            b1 = _mm256_fmadd_ps(q1, _mm256_load_ps(kd + Tp + 8), b1);
        }
        for (; d < Dh; ++d) {
            const __m256 q0 = _mm256_set1_ps(qt[d]);
            a0 = _mm256_fmadd_ps(q0, _mm256_load_ps(kt + d * Tp + j0), a0);
            a1 = _mm256_fmadd_ps(q0, _mm256_load_ps(kt + d * Tp + j0 + 8), a1);
        }
        _mm256_store_ps(s + j0, _mm256_add_ps(a0, b0));
        _mm256_store_ps(s + j0 + 8, _mm256_add_ps(a1, b1));
    }
#else
    for (int64_t j = 0; j < np; ++j) s[j] = 0;
    for (int64_t d = 0; d < Dh; ++d) {
        const real qd = qt[d];
        const real *kd = kt + d * Tp;
#pragma omp simd
        for (int64_t j = 0; j < np; ++j) s[j] += qd * kd[j];
    }
#endif
}

/* out[0..Dh) = sum_{j < n} p_j v_j * inv, v_j the row at v + j * row */
INLINE void attention_values(const real *p, const real *v, int64_t row, int64_t n, int64_t Dh, real inv, real *out) {
    int64_t d0 = 0;
#if VECTOR_SUMS
    for (; d0 + 16 <= Dh; d0 += 16) { /* four keys per step: eight independent chains */
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            const real *vj = v + j * row + d0;
            const __m256 p0 = _mm256_set1_ps(p[j]), p1 = _mm256_set1_ps(p[j + 1]);
            const __m256 p2 = _mm256_set1_ps(p[j + 2]), p3 = _mm256_set1_ps(p[j + 3]);
            c0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vj), c0);
            c1 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vj + 8), c1);
            c2 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vj + row), c2);
            c3 = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vj + row + 8), c3);
            c4 = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vj + 2 * row), c4);
            c5 = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vj + 2 * row + 8), c5);
            c6 = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vj + 3 * row), c6);
            c7 = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vj + 3 * row + 8), c7);
        }
        for (; j < n; ++j) {
            const __m256 p0 = _mm256_set1_ps(p[j]);
            c0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + j * row + d0), c0);
            c1 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + j * row + d0 + 8), c1);
        }
        const __m256 w = _mm256_set1_ps(inv);
        _mm256_storeu_ps(out + d0, _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(c0, c2), _mm256_add_ps(c4, c6)), w));
        _mm256_storeu_ps(out + d0 + 8, _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(c1, c3), _mm256_add_ps(c5, c7)), w));
    }
#endif
    if (d0 < Dh) { /* the portable form, and the columns past the last 16 */
        const int64_t width = Dh - d0;
        real acc[width];
        for (int64_t d = 0; d < width; ++d) acc[d] = 0;
        for (int64_t j = 0; j < n; ++j) {
            const real pj = p[j], *vj = v + j * row + d0;
#pragma omp simd
            for (int64_t d = 0; d < width; ++d) acc[d] += pj * vj[d];
        }
        for (int64_t d = 0; d < width; ++d) out[d0 + d] = acc[d] * inv;
    }
}

/* softmax over the scores s of keys j < n (s holds np >= n, a multiple of KEY_CHUNK, 32-byte aligned) and the mix of
 * values; the keys past n are masked in registers. The float build with AVX2 keeps the running max and sum in
 * registers: the compiler's lowering of these `omp simd` reductions spills the accumulator and reloads it across
 * the scalar remainder, a store the processor cannot forward (a stall per row: a fifth of this kernel's time in
 * perf, docs/kernels.md §2). */
INLINE void attention_softmax_values(real *s, const real *v, int64_t row, int64_t n, int64_t np, int64_t Dh,
                                     real *out) {
#if VECTOR_SUMS
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), minus_inf = _mm256_set1_ps(-INFINITY);
    const __m256 last = _mm256_set1_ps((float)(n - 1)); /* lanes j <= n - 1 are keys (exact: n < 2^24) */
    __m256 mv = minus_inf;
    for (int64_t j = 0; j < np; j += 8) {
        const __m256 key = _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps((float)j)), last, _CMP_LE_OQ);
        mv = _mm256_max_ps(mv, _mm256_blendv_ps(minus_inf, _mm256_load_ps(s + j), key));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 lv = _mm256_setzero_ps();
    for (int64_t j = 0; j < np; j += 8) {
        const __m256 key = _mm256_cmp_ps(_mm256_add_ps(lanes, _mm256_set1_ps((float)j)), last, _CMP_LE_OQ);
        const __m256 e = _mm256_and_ps(key, exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(s + j), m)));
        _mm256_store_ps(s + j, e);
        lv = _mm256_add_ps(lv, e);
    }
    const real l = _mm_cvtss_f32(lane_sums4(lv, _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()));
#else
    real m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < np; ++j) {
        const real x = j < n ? s[j] : -INFINITY;
        m = x > m ? x : m;
    }
    real l = 0;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < np; ++j) {
        const real e = j < n ? exp_nonpositive(s[j] - m) : 0;
        s[j] = e;
        l += e;
    }
#endif
    attention_values(s, v, row, n, Dh, 1 / l, out);
}

static void attention_head(const real *q, const real *k, const real *v, int64_t T, int64_t row, int64_t Dh,
                           real scale, real *out, real *kt, real *s, int64_t Tp) {
    for (int64_t d = 0; d < Dh; ++d) {
        for (int64_t j = 0; j < T; ++j) kt[d * Tp + j] = k[j * row + d] * scale;
        for (int64_t j = T; j < Tp; ++j) kt[d * Tp + j] = 0;
    }
    for (int64_t t = 0; t < T; ++t) {
        const int64_t n = t + 1, np = (n + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK;
        attention_scores(q + t * row, kt, Tp, Dh, np, s);
        attention_softmax_values(s, v, row, n, np, Dh, out + t * row);
    }
}

int causal_attention_forward(const real *q, const real *k, const real *v, int64_t B, int64_t T, int64_t H,
                             int64_t Dh, double scale, real *out, int n_threads) {
    const int64_t Tp = (T + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK, row = H * Dh;
    int failed = 0;
#pragma omp parallel num_threads(n_threads > 1 ? n_threads : 1)
    {
        /* a [Dh, Tp] key block and Tp scores per thread; 64-byte aligned (Tp * sizeof(real) is a multiple of 64) */
        real *block = aligned_alloc(64, (size_t)(Dh + 1) * (size_t)Tp * sizeof(real));
        if (block == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            if (block == NULL) continue;
            const int64_t offset = (bh / H) * T * row + (bh % H) * Dh;
            attention_head(q + offset, k + offset, v + offset, T, row, Dh, (real)scale, out + offset, block,
                           block + Dh * Tp, Tp);
        }
        free(block);
    }
    return failed ? -1 : 0;
}
