/* Fused depth attention for CPU tensors (docs/kernels.md §4-§5). Readable reference: reference.py; math:
 * torch_fast.py.
 * One mix with its backward (optionally with the consumer's pre-norm fused), the mix of stacked copies of a batch,
 * and the multi-query mix of two-phase AttnRes with its backward; wrapped by cpu_depth.py.
 *
 * Each tile of token rows (one row, or TILE of them) is finished before the next one starts: its rows of every
 * source stay in L1/L2, so each source is read from memory once in the forward and once in the backward, and each
 * gradient is written once. The torch path needs ~10 passes over every source for the same work.
 *
 * Layouts: sources and their gradients are S pointers to [N, D] rows; per-token statistics (rstd, logits,
 * weights) and the optional logit bias are [S, N]; the folded-query gradient is summed per thread, and the threads'
 * sums added in thread order after the split (deterministic for a given thread count, no atomics).
 */
#include "cpu_kernels.h"

typedef struct {
    const real *const *sources; /* S pointers, each to [N, D] */
    int64_t n_sources, n_tokens, d_model;
    const real *folded_query;   /* [D], u = w * g */
    const real *bias;           /* [S, N] added to the logits inside the softmax only, or NULL */
    int64_t bias_stride;        /* elements from one source's bias row to the next (N, or more for stacked copies) */
    real eps;
    /* forward outputs / backward inputs */
    real *h;                    /* [N, D] */
    real *rstd, *logits, *weights; /* [S, N] */
    /* backward */
    const real *grad_h;         /* [N, D]; NULL with a fused pre-norm whose input gets no other gradient */
    real *const *grad_sources;  /* S pointers, each to [N, D] */
    const uint8_t *accumulate;  /* [S]: 1 adds source s's gradient into grad_sources[s], 0 writes it; NULL: all 0 */
    real *grad_query_partial;   /* [threads, D], du summed per thread */
    /* the consumer's pre-norm y = RMSNorm(h) * norm_weight, fused (norm_weight NULL: not fused) */
    const real *norm_weight;    /* [D] */
    real norm_eps;
    real *y, *norm_rstd;        /* forward outputs (backward inputs): [N, D], [N] */
    const real *grad_y;         /* [N, D] */
    double *grad_norm_partial;  /* [threads, D], the gain's gradient summed per thread (in double) */
} depth_args;

typedef struct {
    const void *args; /* a depth_args or a multi_args */
    int64_t row_begin, row_end;
    int thread;
} row_range;

/* Forward: sources are reduced GROUP at a time: one row's sums are a chain of dependent FMAs (D / vector width of
 * them, each waiting on the last), so at d_model 64 a row-at-a-time loop was latency-bound; four sources give four
 * independent chains. A tile of TILE tokens is read source group by source group (four contiguous TILE x D
 * streams) or, with few sources, token row by token row (tile_sums), and its softmax statistics are computed for
 * its tokens at once (see forward_rows). Backward: token
 * rows in tiles of TILE, each source read as one contiguous TILE x D block (a stream the prefetcher follows) while
 * the tile's dh rows stay in L1; row-at-a-time it hops between 2S streams per token, much slower at many sources,
 * but with few sources row-at-a-time is faster, so the backward reads by blocks only from 9 sources on
 * (see backward_rows). One source at a time was slower for the forward's reads too (docs/kernels.md
 * §6): a single stream does not keep enough reads in flight. Results are the same sums, only interleaved. */
#define TILE 16
#define GROUP 4

/* v_i . a_i and v_i . b_i for four rows v0..v3: eight independent FMA chains. Inlined, a vector passed for several
 * rows is loaded once (the same address): group_sums dots each row with itself and one query, group_dot_pairs
 * four rows with two shared vectors. */
INLINE void eight_dots(const real *v0, const real *v1, const real *v2, const real *v3, const real *a0,
                       const real *a1, const real *a2, const real *a3, const real *b0, const real *b1,
                       const real *b2, const real *b3, int64_t D, real *dot_a, real *dot_b) {
#if VECTOR_SUMS
    __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, q0 = p0, q1 = p0, q2 = p0, q3 = p0;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 x0 = _mm256_loadu_ps(v0 + d), x1 = _mm256_loadu_ps(v1 + d), x2 = _mm256_loadu_ps(v2 + d),
                     x3 = _mm256_loadu_ps(v3 + d);
        p0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(a0 + d), p0), p1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(a1 + d), p1);
        p2 = _mm256_fmadd_ps(x2, _mm256_loadu_ps(a2 + d), p2), p3 = _mm256_fmadd_ps(x3, _mm256_loadu_ps(a3 + d), p3);
        q0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(b0 + d), q0), q1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(b1 + d), q1);
        q2 = _mm256_fmadd_ps(x2, _mm256_loadu_ps(b2 + d), q2), q3 = _mm256_fmadd_ps(x3, _mm256_loadu_ps(b3 + d), q3);
    }
    _mm_storeu_ps(dot_a, lane_sums4(p0, p1, p2, p3));
    _mm_storeu_ps(dot_b, lane_sums4(q0, q1, q2, q3));
    for (; d < D; ++d) {
        dot_a[0] += v0[d] * a0[d], dot_a[1] += v1[d] * a1[d], dot_a[2] += v2[d] * a2[d], dot_a[3] += v3[d] * a3[d];
        dot_b[0] += v0[d] * b0[d], dot_b[1] += v1[d] * b1[d], dot_b[2] += v2[d] * b2[d], dot_b[3] += v3[d] * b3[d];
    }
#else
    real p0 = 0, p1 = 0, p2 = 0, p3 = 0, q0 = 0, q1 = 0, q2 = 0, q3 = 0;
#pragma omp simd reduction(+ : p0, p1, p2, p3, q0, q1, q2, q3)
    for (int64_t d = 0; d < D; ++d) {
        p0 += v0[d] * a0[d], p1 += v1[d] * a1[d], p2 += v2[d] * a2[d], p3 += v3[d] * a3[d];
        q0 += v0[d] * b0[d], q1 += v1[d] * b1[d], q2 += v2[d] * b2[d], q3 += v3[d] * b3[d];
    }
    dot_a[0] = p0, dot_a[1] = p1, dot_a[2] = p2, dot_a[3] = p3;
    dot_b[0] = q0, dot_b[1] = q1, dot_b[2] = q2, dot_b[3] = q3;
#endif
}

/* each row's square sum and its dot with u */
INLINE void group_sums(const real *v0, const real *v1, const real *v2, const real *v3, const real *u, int64_t D,
                       real *square_sum, real *dot) {
    eight_dots(v0, v1, v2, v3, v0, v1, v2, v3, u, u, u, u, D, square_sum, dot);
}

/* each row's dots with x and with y */
INLINE void group_dot_pairs(const real *v0, const real *v1, const real *v2, const real *v3, const real *x,
                            const real *y, int64_t D, real *dot_x, real *dot_y) {
    eight_dots(v0, v1, v2, v3, x, x, x, x, y, y, y, y, D, dot_x, dot_y);
}

/* four dots v_i . g_i at once (four independent FMA chains) */
INLINE void four_dots(const real *v0, const real *v1, const real *v2, const real *v3, const real *g0,
                      const real *g1, const real *g2, const real *g3, int64_t D, real *dot) {
#if VECTOR_SUMS
    __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        p0 = _mm256_fmadd_ps(_mm256_loadu_ps(v0 + d), _mm256_loadu_ps(g0 + d), p0);
        p1 = _mm256_fmadd_ps(_mm256_loadu_ps(v1 + d), _mm256_loadu_ps(g1 + d), p1);
        p2 = _mm256_fmadd_ps(_mm256_loadu_ps(v2 + d), _mm256_loadu_ps(g2 + d), p2);
        p3 = _mm256_fmadd_ps(_mm256_loadu_ps(v3 + d), _mm256_loadu_ps(g3 + d), p3);
    }
    _mm_storeu_ps(dot, lane_sums4(p0, p1, p2, p3));
    for (; d < D; ++d) dot[0] += v0[d] * g0[d], dot[1] += v1[d] * g1[d], dot[2] += v2[d] * g2[d], dot[3] += v3[d] * g3[d];
#else
    real p0 = 0, p1 = 0, p2 = 0, p3 = 0;
#pragma omp simd reduction(+ : p0, p1, p2, p3)
    for (int64_t d = 0; d < D; ++d) {
        p0 += v0[d] * g0[d];
        p1 += v1[d] * g1[d];
        p2 += v2[d] * g2[d];
        p3 += v3[d] * g3[d];
    }
    dot[0] = p0, dot[1] = p1, dot[2] = p2, dot[3] = p3;
#endif
}

/* row-wise dots of T consecutive rows of v with the matching rows of g */
INLINE void tile_dots(const real *v, const real *g, int64_t D, int64_t T, real *dot) {
    int64_t n = 0;
    for (; n + GROUP <= T; n += GROUP) {
        const real *v0 = v + n * D, *g0 = g + n * D;
        four_dots(v0, v0 + D, v0 + 2 * D, v0 + 3 * D, g0, g0 + D, g0 + 2 * D, g0 + 3 * D, D, dot + n);
    }
    for (; n < T; ++n) {
        real p = 0;
#pragma omp simd reduction(+ : p)
        for (int64_t d = 0; d < D; ++d) p += v[n * D + d] * g[n * D + d];
        dot[n] = p;
    }
}

/* Software prefetch of one token row of every source, PREFETCH_ROWS tokens ahead: a mix reads S streams at once,
 * more than the hardware prefetchers follow, and at depth the sources come from memory (docs/kernels.md §6). */
#ifndef PREFETCH_ROWS /* analyses/bench_cold_mix.py builds it with others */
#define PREFETCH_ROWS 4
#endif
INLINE void prefetch_rows(const real *const *src, int64_t S, int64_t offset, int64_t D) {
    const int64_t line = 64 / (int64_t)sizeof(real);
    for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; d += line) __builtin_prefetch(src[s] + offset + d, 0, 3);
}

/* h += sum_s alpha[s * TILE] v_s for one token row (alpha points at the token's entry of a tile's weights).
 * With vector sums, 64 columns of h stay in eight registers while every source is added (eight independent FMA
 * chains, one load per source vector), where GROUP sources per sweep reload and store h every four sources. */
INLINE void mix_row(real *h, const real *const *src, int64_t S, int64_t row, int64_t D, const real *alpha) {
#if VECTOR_SUMS
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 acc[8];
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(h + d + 8 * c);
        for (int64_t s = 0; s < S; ++s) {
            const __m256 w = _mm256_set1_ps(alpha[s * TILE]);
            const real *v = src[s] + row + d;
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(h + d + 8 * c, acc[c]);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 acc = _mm256_loadu_ps(h + d);
        for (int64_t s = 0; s < S; ++s)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(alpha[s * TILE]), _mm256_loadu_ps(src[s] + row + d), acc);
        _mm256_storeu_ps(h + d, acc);
    }
    for (; d < D; ++d) { /* fma spelt out: left to contraction, GCC fused a * v + x in some inlined copies of this
                          * loop and not in others, and a remixed h then differed from the forward's in these columns */
        real x = h[d];
        for (int64_t s = 0; s < S; ++s) x = fma(alpha[s * TILE], src[s][row + d], x);
        h[d] = x;
    }
#else
    int64_t s = 0;
    for (; s + GROUP <= S; s += GROUP) {
        const real *v0 = src[s] + row, *v1 = src[s + 1] + row, *v2 = src[s + 2] + row, *v3 = src[s + 3] + row;
        const real w0 = alpha[s * TILE], w1 = alpha[(s + 1) * TILE], w2 = alpha[(s + 2) * TILE],
                   w3 = alpha[(s + 3) * TILE];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) h[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
    }
    for (; s < S; ++s) {
        const real *v = src[s] + row, ws = alpha[s * TILE];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) h[d] += ws * v[d];
    }
#endif
}

/* Which order the forward's pass 1 reads a tile in. From this many sources on, source group by source group (four
 * streams of TILE x D contiguous values at a time); below it, token row by token row (row t of every source, then
 * row t + 1: S streams at once) with software prefetch. With sources from memory, many sources read faster by
 * groups and a few row by row; where the switch lies was measured on two processors (docs/kernels.md §11). */
#ifndef GROUPED_FORWARD_MIN_SOURCES /* analyses/bench_cold_mix.py builds it with others */
#define GROUPED_FORWARD_MIN_SOURCES 8
#endif

/* Pass 1's sums of token t0 + t for the sources s..s+GROUP-1 into [S, TILE] tables; a short last group repeats its
 * last source and drops the repeats' sums (the lines are in L1 already), so every source's sums come from
 * group_sums in either reading order */
INLINE void tile_sums(const depth_args *a, int64_t s, int64_t t0, int64_t t, real *square_sums, real *dots) {
    const int64_t S = a->n_sources, D = a->d_model, row = (t0 + t) * D;
    const real *const *src = a->sources;
    real q[GROUP], p[GROUP];
    group_sums(src[s] + row, src[s + 1 < S ? s + 1 : S - 1] + row, src[s + 2 < S ? s + 2 : S - 1] + row,
               src[s + 3 < S ? s + 3 : S - 1] + row, a->folded_query, D, q, p);
    for (int g = 0; g < GROUP && s + g < S; ++g)
        square_sums[(s + g) * TILE + t] = q[g], dots[(s + g) * TILE + t] = p[g];
}

/* Forward, in tiles of TILE tokens: pass 1 reads the tile's rows of every source once for its two sums, GROUP
 * sources side by side (four independent FMA chains), source group by source group or token row by token row
 * (tile_sums, GROUPED_FORWARD_MIN_SOURCES); the per-token statistics (rstd, logits, softmax) are then computed
 * for the whole tile, vectorised across its tokens (one token at a time they were scalar sqrt, division and exp
 * per source, more than the reads cost); pass 2 mixes the rows, still in L1/L2. */
static void forward_rows(const depth_args *a, int64_t begin, int64_t end) {
    const int64_t S = a->n_sources, N = a->n_tokens, D = a->d_model;
    const real *const *src = a->sources;
    real square_sums[S * TILE], dots[S * TILE], w[S * TILE], max_logit[TILE], total[TILE];
    real h_row[a->h ? 1 : D]; /* h not kept (NULL, which the caller passes only with the pre-norm fused): rows here */
    for (int64_t t0 = begin; t0 < end; t0 += TILE) {
        const int64_t T = end - t0 < TILE ? end - t0 : TILE;
        /* pass 1: rstd and logit sums of every source, one read of each row for both; the same sums in either
         * reading order (see GROUPED_FORWARD_MIN_SOURCES) */
        if (S >= GROUPED_FORWARD_MIN_SOURCES) {
            for (int64_t s = 0; s < S; s += GROUP)
                for (int64_t t = 0; t < T; ++t) tile_sums(a, s, t0, t, square_sums, dots);
        } else {
            for (int64_t t = 0; t < T; ++t) {
                if (t0 + t + PREFETCH_ROWS < end) prefetch_rows(src, S, (t0 + t + PREFETCH_ROWS) * D, D);
                for (int64_t s = 0; s < S; s += GROUP) tile_sums(a, s, t0, t, square_sums, dots);
            }
        }
        /* statistics, across the tile's tokens */
        for (int64_t t = 0; t < T; ++t) max_logit[t] = -INFINITY, total[t] = 0;
        for (int64_t s = 0; s < S; ++s) {
            const real *bias = a->bias ? a->bias + s * a->bias_stride + t0 : NULL;
            real *rstd = a->rstd + s * N + t0, *logits = a->logits + s * N + t0, *z = w + s * TILE;
#pragma omp simd
            for (int64_t t = 0; t < T; ++t) {
                const real r = (real)1 / sqrt(square_sums[s * TILE + t] / (real)D + a->eps);
                rstd[t] = r;
                logits[t] = dots[s * TILE + t] * r; /* unbiased: the backward's key term needs r (u . v) itself */
                z[t] = logits[t] + (bias ? bias[t] : 0);
                max_logit[t] = z[t] > max_logit[t] ? z[t] : max_logit[t];
            }
        }
        for (int64_t s = 0; s < S; ++s) {
            real *e = w + s * TILE;
#pragma omp simd
            for (int64_t t = 0; t < T; ++t) {
                e[t] = exp_nonpositive(e[t] - max_logit[t]); /* a bias of -inf gives weight 0 */
                total[t] += e[t];
            }
        }
        for (int64_t s = 0; s < S; ++s) {
            real *weights = a->weights + s * N + t0, *alpha = w + s * TILE;
#pragma omp simd
            for (int64_t t = 0; t < T; ++t) weights[t] = alpha[t] = alpha[t] / total[t];
        }
        /* pass 2: h = sum_s alpha_s v_s, the rows still in L1/L2, and the fused pre-norm of h while it is */
        for (int64_t t = 0; t < T; ++t) {
            const int64_t row = (t0 + t) * D;
            real *h = a->h ? a->h + row : h_row;
            for (int64_t d = 0; d < D; ++d) h[d] = 0;
            mix_row(h, src, S, row, D, w + t);
            if (a->norm_weight) a->norm_rstd[t0 + t] = norm_row(h, a->norm_weight, D, a->norm_eps, a->y + row);
        }
    }
}

/* Token n's row of h = sum_s alpha_s v_s, mixed again for the fused pre-norm's backward where the forward did not
 * keep h (docs/kernels.md §4): the same mix_row as the forward's, with the same weights, so the same values bit for
 * bit; the backward reads these source rows next anyway. alpha is scratch of S * TILE values. */
INLINE const real *mixed_row(const depth_args *a, int64_t n, int64_t D, real *h, real *alpha) {
    if (a->h) return a->h + n * D;
    for (int64_t s = 0; s < a->n_sources; ++s) alpha[s * TILE] = a->weights[s * a->n_tokens + n];
    for (int64_t d = 0; d < D; ++d) h[d] = 0;
    mix_row(h, a->sources, a->n_sources, n * D, D, alpha);
    return h;
}

/* Rows t0..t0+T of h for the tiled backward, mixed source group by source group (four streams of contiguous rows,
 * as the forward reads them, where row by row the S streams advance one row at a time) into an h tile that stays
 * in L1. Each call of mix_row adds one group (or one of the last sources) in mix_row's own grouping and order, so
 * these are the forward's sums bit for bit. alpha is [S, TILE]: the tile's weights. */
INLINE void mixed_tile(const depth_args *a, int64_t t0, int64_t T, int64_t D, real *h, real *alpha) {
    const int64_t S = a->n_sources;
    for (int64_t s = 0; s < S; ++s)
        for (int64_t t = 0; t < T; ++t) alpha[s * TILE + t] = a->weights[s * a->n_tokens + t0 + t];
    for (int64_t i = 0; i < T * D; ++i) h[i] = 0;
    for (int64_t s = 0, group; s < S; s += group) {
        group = S - s >= GROUP ? GROUP : 1;
        for (int64_t t = 0; t < T; ++t) mix_row(h + t * D, a->sources + s, group, (t0 + t) * D, D, alpha + s * TILE + t);
    }
}

/* Per token (r_s = rstd, l_s = unbiased logit, delta = dh . h = sum_s alpha_s (dh . v_s)):
 *   dlogit_s = alpha_s (dh . v_s - delta)
 *   dv_s     = alpha_s dh + dlogit_s r_s u - dlogit_s l_s r_s^2 / D v_s
 *   du      += dlogit_s r_s v_s
 * A logit bias enters only through alpha (saved from the forward), so the backward is the same with or without.
 * dv_s is written, or with accumulate[s] added to what grad_sources[s] holds: a source that many consumers read
 * then gets its gradient summed in one buffer as it is written, where autograd would add each consumer's fresh
 * copy in a separate pass (docs/kernels.md §5).
 */
INLINE void backward_by_token(const depth_args *a, int64_t begin, int64_t end, real *grad_u, double *grad_norm,
                              const int64_t D) {
    const int64_t S = a->n_sources, N = a->n_tokens;
    const real *u = a->folded_query;
    const int remix = a->norm_weight && !a->h; /* the fused pre-norm's backward without a kept h: mixed_row */
    real dots[S], fused_dh[a->norm_weight ? D : 1], h_row[remix ? D : 1], alpha[remix ? S * TILE : 1];
    for (int64_t n = begin; n < end; ++n) {
        const real *dh = a->grad_h ? a->grad_h + n * D : NULL;
        if (a->norm_weight) {
            norm_row_backward(mixed_row(a, n, D, h_row, alpha), a->norm_weight, a->norm_rstd[n], a->grad_y + n * D,
                              dh, D, fused_dh, grad_norm);
            dh = fused_dh;
        }
        real delta = 0;
        int64_t s = 0;
        for (; s + GROUP <= S; s += GROUP) { /* four independent chains, lanes summed together (four_dots) */
            const int64_t row = n * D;
            four_dots(a->sources[s] + row, a->sources[s + 1] + row, a->sources[s + 2] + row, a->sources[s + 3] + row,
                      dh, dh, dh, dh, D, dots + s);
        }
        for (; s < S; ++s) {
            const real *v = a->sources[s] + n * D;
            real dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += v[d] * dh[d];
            dots[s] = dot;
        }
        for (s = 0; s < S; ++s) delta += a->weights[s * N + n] * dots[s];
        for (int64_t s = 0; s < S; ++s) {
            const real w = a->weights[s * N + n], r = a->rstd[s * N + n];
            const real key_coef = w * (dots[s] - delta) * r;
            const real value_coef = key_coef * a->logits[s * N + n] * r / (real)D;
            const real *v = a->sources[s] + n * D;
            real *grad = a->grad_sources[s] + n * D;
            const int keep = a->accumulate && a->accumulate[s];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) {
                grad[d] = (keep ? grad[d] : 0) + w * dh[d] + key_coef * u[d] - value_coef * v[d];
                grad_u[d] += key_coef * v[d];
            }
        }
    }
}

INLINE void backward_by_tile(const depth_args *a, int64_t begin, int64_t end, real *grad_u, double *grad_norm,
                             const int64_t D) {
    const int64_t S = a->n_sources, N = a->n_tokens;
    const real *u = a->folded_query;
    const int remix = a->norm_weight && !a->h; /* the fused pre-norm's backward without a kept h: mixed_tile */
    real dots[S * TILE], delta[TILE], fused_dh[a->norm_weight ? TILE * D : 1], h_tile[remix ? TILE * D : 1],
        alpha[remix ? S * TILE : 1];
    for (int64_t t0 = begin; t0 < end; t0 += TILE) {
        const int64_t T = end - t0 < TILE ? end - t0 : TILE;
        const real *dh = a->grad_h ? a->grad_h + t0 * D : NULL;
        if (a->norm_weight) {
            const real *h = a->h ? a->h + t0 * D : h_tile;
            if (remix) mixed_tile(a, t0, T, D, h_tile, alpha);
            for (int64_t n = 0; n < T; ++n)
                norm_row_backward(h + n * D, a->norm_weight, a->norm_rstd[t0 + n], a->grad_y + (t0 + n) * D,
                                  dh ? dh + n * D : NULL, D, fused_dh + n * D, grad_norm);
            dh = fused_dh;
        }
        for (int64_t n = 0; n < T; ++n) delta[n] = 0;
        for (int64_t s = 0; s < S; ++s) {
            tile_dots(a->sources[s] + t0 * D, dh, D, T, dots + s * TILE);
            for (int64_t n = 0; n < T; ++n) delta[n] += a->weights[s * N + t0 + n] * dots[s * TILE + n];
        }
        /* the gradients, GROUP sources side by side: each token row of four sources, then the next row (four
         * streams of gradient rows read and written; one source's tile after another measured slower) */
        for (int64_t s0 = 0; s0 < S; s0 += GROUP)
            for (int64_t n = 0; n < T; ++n)
                for (int64_t s = s0; s < S && s < s0 + GROUP; ++s) {
                    const int64_t i = s * N + t0 + n;
                    const real w = a->weights[i], r = a->rstd[i];
                    const real key_coef = w * (dots[s * TILE + n] - delta[n]) * r;
                    const real value_coef = key_coef * a->logits[i] * r / (real)D;
                    const real *vn = a->sources[s] + (t0 + n) * D, *dhn = dh + n * D;
                    real *gn = a->grad_sources[s] + (t0 + n) * D;
                    const int keep = a->accumulate && a->accumulate[s];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) {
                        gn[d] = (keep ? gn[d] : 0) + w * dhn[d] + key_coef * u[d] - value_coef * vn[d];
                        grad_u[d] += key_coef * vn[d];
                    }
                }
    }
}

/* Below this many sources the by-token loop is faster (its 2S streams still prefetch well); from it on the tiled
 * one, whose remix of h (mixed_tile) reads by source groups (the measurements: docs/kernels.md §6 and §11). */
#ifndef TILED_BACKWARD_MIN_SOURCES /* analyses/bench_cold_mix.py builds it with others */
#define TILED_BACKWARD_MIN_SOURCES 9
#endif

INLINE void backward_rows_d(const depth_args *a, int64_t begin, int64_t end, real *grad_u, double *grad_norm,
                            const int64_t D) {
    if (a->n_sources >= TILED_BACKWARD_MIN_SOURCES) backward_by_tile(a, begin, end, grad_u, grad_norm, D);
    else backward_by_token(a, begin, end, grad_u, grad_norm, D);
}

/* The backward is inlined into one copy per common d_model, where the width is a compile-time constant, and a
 * generic copy: with the trip count known the compiler unrolls the vector loops and keeps the accumulators in
 * registers, faster at d_model 64 and at few sources of 128 (the same sums, bit for bit). The forward
 * measured no gain from it (docs/kernels.md §6). */
static void backward_rows(const depth_args *a, int64_t begin, int64_t end, real *grad_u, double *grad_norm) {
    switch (a->d_model) {
    case 32: backward_rows_d(a, begin, end, grad_u, grad_norm, 32); break;
    case 64: backward_rows_d(a, begin, end, grad_u, grad_norm, 64); break;
    case 128: backward_rows_d(a, begin, end, grad_u, grad_norm, 128); break;
    case 256: backward_rows_d(a, begin, end, grad_u, grad_norm, 256); break;
    default: backward_rows_d(a, begin, end, grad_u, grad_norm, a->d_model);
    }
}

static void *forward_worker(void *arg) {
    const row_range *range = arg;
    forward_rows((const depth_args *)range->args, range->row_begin, range->row_end);
    return NULL;
}

static void *backward_worker(void *arg) {
    const row_range *range = arg;
    const depth_args *a = (const depth_args *)range->args;
    const size_t query_bytes = (size_t)a->d_model * sizeof(real), norm_bytes = (size_t)a->d_model * sizeof(double);
    real *query_row = a->grad_query_partial + range->thread * a->d_model;
    double *norm_row = a->norm_weight ? a->grad_norm_partial + range->thread * a->d_model : NULL;
    real *grad_u = thread_sums(query_row, query_bytes);
    double *grad_norm = norm_row ? thread_sums(norm_row, norm_bytes) : NULL;
    backward_rows(a, range->row_begin, range->row_end, grad_u, grad_norm);
    release_thread_sums(grad_u, query_row, query_bytes);
    if (norm_row) release_thread_sums(grad_norm, norm_row, norm_bytes);
    return NULL;
}

/* Split the rows into n_threads contiguous ranges and run each on its own thread, the calling thread included.
 * Built with OpenMP (docs/kernels.md §6), the threads are those of torch's own OpenMP pool: the library's libgomp
 * is the one torch loaded (same soname), whose threads are awake between torch's ops, so a split pays from tens
 * of thousands of elements; a pthread started per call costs far more and pays only from about a million.
 * Without OpenMP, pthreads: a thread that cannot be started has its range run here, so the result never depends
 * on it. */
static void run_rows(void *(*worker)(void *), const void *a, int64_t n_tokens, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    row_range ranges[MAX_THREADS];
    /* ranges start at multiples of TILE, so every row is tiled (and grouped) as in a one-thread run: the split
     * cannot change a row's result */
    const int64_t per_thread = ((n_tokens + n_threads - 1) / n_threads + TILE - 1) / TILE * TILE;
    for (int t = 0; t < n_threads; ++t) {
        int64_t begin = t * per_thread, end = begin + per_thread;
        if (begin > n_tokens) begin = n_tokens;
        if (end > n_tokens) end = n_tokens;
        ranges[t] = (row_range){a, begin, end, t};
    }
    if (n_threads == 1) {
        worker(&ranges[0]);
        return;
    }
#ifdef _OPENMP
    /* one range per iteration: a team smaller than asked for still runs every range */
#pragma omp parallel for num_threads(n_threads) schedule(static, 1)
    for (int t = 0; t < n_threads; ++t) worker(&ranges[t]);
#else
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < n_threads; ++t) started[t] = pthread_create(&threads[t], NULL, worker, &ranges[t]) == 0;
    worker(&ranges[0]);
    for (int t = 1; t < n_threads; ++t) {
        if (started[t]) pthread_join(threads[t], NULL);
        else worker(&ranges[t]);
    }
#endif
}

/* One mix: h [N, D] and stats, a [3, S, N] block of rstd, unbiased logits and weights (the backward's inputs). With
 * the consumer's pre-norm fused (docs/kernels.md §4; norm_weight not NULL) the forward also writes
 * y = RMSNorm(h) * norm_weight and its rstd while each h row is in L1, and the backward turns dy (plus dh, when h
 * has other uses; else grad_h is NULL) into dh row by row before the mix's backward, with the gain's gradient
 * summed per thread, in double. Without it those pointers are NULL. With it, h may be NULL where nothing reads h
 * (a model's sublayer reads y only): each row is then mixed on the stack, and the backward (h NULL there too) mixes
 * it again from the sources it reads anyway, so h is neither written nor read back. With gain given, query is the
 * pseudo-query w and the kernel takes u = w * g itself (the eager autograd node: no tensor op of its own); without,
 * query is u already (the custom op, whose product autograd differentiates). */
void depth_attention_forward(const real *const *sources, int64_t n_sources, int64_t n_tokens, int64_t d_model,
                             const real *query, const real *gain, const real *bias, double eps,
                             const real *norm_weight, double norm_eps, real *h, real *stats, real *y, real *norm_rstd,
                             int n_threads) {
    const int64_t cells = n_sources * n_tokens;
    real folded[gain ? d_model : 1];
    if (gain)
        for (int64_t d = 0; d < d_model; ++d) folded[d] = query[d] * gain[d]; /* torch's product, bit for bit */
    const depth_args a = {.sources = sources, .n_sources = n_sources, .n_tokens = n_tokens, .d_model = d_model,
                          .folded_query = gain ? folded : query, .bias = bias, .bias_stride = n_tokens,
                          .eps = (real)eps,
                          .h = h, .rstd = stats, .logits = stats + cells, .weights = stats + 2 * cells,
                          .norm_weight = norm_weight, .norm_eps = (real)norm_eps, .y = y, .norm_rstd = norm_rstd};
    run_rows(forward_worker, &a, n_tokens, n_threads);
}

/* Copies of one batch stacked along the tokens (exact interventions: one copy per intervention), each with its own
 * logit bias, mixed without a gradient and without reading what they share once per copy (docs/kernels.md §7).
 * sources[0 .. n_shared) hold one copy's n_tokens rows, which every copy reads; the others hold all n_copies *
 * n_tokens rows, copy k's from row k * n_tokens. bias is [S, n_copies * n_tokens] or NULL, h [n_copies * n_tokens,
 * D]; with norm_weight, y = RMSNorm(h) * norm_weight (the consumer's pre-norm, fused as in the one-pass mix) and its
 * rstd ([n_copies * n_tokens]); stats ([3, S, n_tokens]) is scratch that every copy overwrites. Each thread mixes spans of COPY_SPAN tokens,
 * every copy's rows of a span in turn, so the span's shared rows (COPY_SPAN x n_shared x D values, in L2) come from
 * memory once where the stacked one-pass mix reads each copy's duplicate. Spans start at multiples of TILE, so a
 * copy's row is tiled as in the stacked mix when n_tokens is a multiple of TILE. Returns -1 when the per-copy
 * source tables cannot be allocated (nothing is written). */
#define COPY_SPAN (4 * TILE)

typedef struct {
    const depth_args *copies;
    int64_t n_copies;
} copies_args;

static void *copies_worker(void *arg) {
    const row_range *range = arg;
    const copies_args *c = range->args;
    for (int64_t begin = range->row_begin; begin < range->row_end; begin += COPY_SPAN) {
        const int64_t end = begin + COPY_SPAN < range->row_end ? begin + COPY_SPAN : range->row_end;
        for (int64_t k = 0; k < c->n_copies; ++k) forward_rows(&c->copies[k], begin, end);
    }
    return NULL;
}

int depth_attention_copies_forward(const real *const *sources, int64_t n_sources, int64_t n_shared, int64_t n_copies,
                                   int64_t n_tokens, int64_t d_model, const real *folded_query, const real *bias,
                                   double eps, const real *norm_weight, double norm_eps, real *h, real *y,
                                   real *norm_rstd, real *stats, int n_threads) {
    depth_args *copies = malloc((size_t)n_copies * sizeof *copies);
    const real **tables = malloc((size_t)(n_copies * n_sources) * sizeof *tables);
    if (copies == NULL || tables == NULL) {
        free(copies);
        free(tables);
        return -1;
    }
    const int64_t stacked = n_copies * n_tokens;
    for (int64_t k = 0; k < n_copies; ++k) {
        const real **table = tables + k * n_sources;
        for (int64_t s = 0; s < n_sources; ++s)
            table[s] = s < n_shared ? sources[s] : sources[s] + k * n_tokens * d_model;
        copies[k] = (depth_args){.sources = table, .n_sources = n_sources, .n_tokens = n_tokens,
                                 .d_model = d_model, .folded_query = folded_query,
                                 .bias = bias ? bias + k * n_tokens : NULL, .bias_stride = stacked, .eps = (real)eps,
                                 .h = h + k * n_tokens * d_model, .rstd = stats, .logits = stats + n_sources * n_tokens,
                                 .weights = stats + 2 * n_sources * n_tokens, .norm_weight = norm_weight,
                                 .norm_eps = (real)norm_eps, .y = norm_weight ? y + k * n_tokens * d_model : NULL,
                                 .norm_rstd = norm_weight ? norm_rstd + k * n_tokens : NULL};
    }
    const copies_args c = {copies, n_copies};
    run_rows(copies_worker, &c, n_tokens, n_threads);
    free(copies);
    free(tables);
    return 0;
}

/* The backward of one mix. stats is the forward's [3, S, N] block (rstd, unbiased logits, weights). The parameters'
 * gradients come reduced: each thread's sums of du (and of the fused pre-norm's gain, in double) are added in
 * thread order after the split, into grad_query as dw = du * g and grad_gain as dg = du * w for u = w * g when query
 * and gain are given (the eager autograd node, whose query the kernel folds), else into grad_query as du (the
 * custom op, whose product autograd differentiates); grad_norm_weight gets the gain's gradient with a fused
 * pre-norm. folded_query may be NULL where query and gain are given: u is then their product, as the forward took
 * it. Returns 0, or -1 when the threads' [threads, D] blocks of sums cannot be allocated (nothing written). */
int depth_attention_backward(const real *const *sources, int64_t n_sources, int64_t n_tokens, int64_t d_model,
                             const real *folded_query, const real *query, const real *gain, const real *stats,
                             const real *h, const real *norm_weight, const real *norm_rstd, const real *grad_y,
                             const real *grad_h, real *const *grad_sources, const uint8_t *accumulate,
                             real *grad_query, real *grad_gain, real *grad_norm_weight, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    const int64_t D = d_model, cells = n_sources * n_tokens;
    real folded[folded_query ? 1 : D];
    if (!folded_query) {
        for (int64_t d = 0; d < D; ++d) folded[d] = query[d] * gain[d];
        folded_query = folded;
    }
    real *query_sums = malloc((size_t)(n_threads * D) * sizeof(real));
    double *norm_sums = norm_weight ? malloc((size_t)(n_threads * D) * sizeof(double)) : NULL;
    if (query_sums == NULL || (norm_weight && norm_sums == NULL)) {
        free(query_sums);
        free(norm_sums);
        return -1;
    }
    const depth_args a = {.sources = sources, .n_sources = n_sources, .n_tokens = n_tokens, .d_model = d_model,
                          .folded_query = folded_query, .rstd = (real *)stats, .logits = (real *)stats + cells,
                          .weights = (real *)stats + 2 * cells, .h = (real *)h, .grad_h = grad_h,
                          .grad_sources = grad_sources, .accumulate = accumulate, .grad_query_partial = query_sums,
                          .norm_weight = norm_weight, .norm_rstd = (real *)norm_rstd, .grad_y = grad_y,
                          .grad_norm_partial = norm_sums};
    run_rows(backward_worker, &a, n_tokens, n_threads);
    for (int64_t d = 0; d < D; ++d) {
        real du = 0;
        for (int t = 0; t < n_threads; ++t) du += query_sums[t * D + d];
        if (query) {
            grad_query[d] = du * gain[d];
            grad_gain[d] = du * query[d];
        } else {
            grad_query[d] = du;
        }
        if (norm_weight) {
            double total = 0;
            for (int t = 0; t < n_threads; ++t) total += norm_sums[t * D + d];
            grad_norm_weight[d] = (real)total;
        }
    }
    free(query_sums);
    free(norm_sums);
    return 0;
}

/* Without a backward (no_grad: inference, exact interventions), several consumers read the same sources: Q folded
 * queries u_q are scored against S sources in one read of each source row, and each query's softmax may include
 * a prior part, a mix of other sources already reduced to (normalised mix m_q, log-sum-exp l_q) (docs/kernels.md
 * §7). Per token and query, over the parts {prior, s = 0 … S-1} with logits {l_q, z_qs = r_s (u_q . v_s)}:
 *   M = max(l_q, max_s z_qs),  e_s = exp(z_qs - M),  e_p = exp(l_q - M),  E = e_p + sum_s e_s
 *   mix_q = (e_p m_q + sum_s e_s v_s) / E,   lse_q = M + log E
 * which equals one softmax over the prior's sources and these together. Phase 1 of two-phase AttnRes is a call
 * without prior; phase 2 (the sources phase 1 could not see) a call with Q = 1 and phase 1's part as the prior.
 * Layouts: queries [Q, D]; mix and lse Q pointers each, to [N, D] and [N]; prior_mix [Q, P, D] and prior_lse [Q, P] for
 * P prior tokens, a divisor of N: token n takes prior row n mod P, so sources that stack N / P copies of a batch
 * along their leading dim take one copy's prior (sources the copies share, mixed once: docs/kernels.md §7). */
#define MAX_QUERIES 8 /* cpu_depth.py splits larger query sets */

/* One token row n of every source: each row's square sum and its dots with every u_q and (grad_mix not NULL) dh_q,
 * four source rows at a time (group_sums, group_dot_pairs), into square, z and g at token t of their [S, TILE] and
 * [Q, S, TILE] tables (g may be NULL without grad_mix; a query without dh gets zeros in g); a short last group
 * repeats its last source and drops the repeats' dots. */
INLINE void row_dots(const real *const *src, int64_t S, int64_t D, int64_t n, int64_t t, const real *queries,
                     int64_t Q, const real *const *grad_mix, int64_t grad_stride, real *square, real *z, real *g) {
    const real *with[2 * MAX_QUERIES]; /* after u_0: dh_0, u_1, dh_1, ... (queries without dh left out) */
    real *into[2 * MAX_QUERIES];      /* each one's table, at token t of source 0 */
    int k = 0;
    for (int64_t q = 0; q < Q; ++q) {
        if (q > 0) with[k] = queries + q * D, into[k++] = z + q * S * TILE + t;
        if (grad_mix && grad_mix[q]) with[k] = grad_mix[q] + n * grad_stride, into[k++] = g + q * S * TILE + t;
    }
    for (int64_t s = 0; s < S; s += GROUP) {
        const real *v[GROUP];
        for (int i = 0; i < GROUP; ++i) v[i] = src[s + i < S ? s + i : S - 1] + n * D;
        real first[GROUP], second[GROUP], sums[GROUP];
        const int used = S - s < GROUP ? (int)(S - s) : GROUP;
        group_sums(v[0], v[1], v[2], v[3], queries, D, sums, first);
        for (int i = 0; i < used; ++i) square[(s + i) * TILE + t] = sums[i], z[(s + i) * TILE + t] = first[i];
        for (int j = 0; j < k; j += 2) {
            const real *y = j + 1 < k ? with[j + 1] : with[j];
            group_dot_pairs(v[0], v[1], v[2], v[3], with[j], y, D, first, second);
            for (int i = 0; i < used; ++i) {
                into[j][(s + i) * TILE] = first[i];
                if (j + 1 < k) into[j + 1][(s + i) * TILE] = second[i];
            }
        }
    }
    if (grad_mix)
        for (int64_t q = 0; q < Q; ++q)
            if (!grad_mix[q])
                for (int64_t s = 0; s < S; ++s) g[(q * S + s) * TILE + t] = 0;
}


typedef struct {
    const real *const *sources;
    int64_t n_sources, n_tokens, d_model, n_queries, prior_tokens;
    const real *queries, *prior_mix, *prior_lse;
    real eps;
    real *const *mix, *const *lse; /* Q pointers each, to N rows of D (mix_stride apart) and to [N] */
    int64_t mix_stride;
    /* the routed op's knobs (depth_attention_routed; docs/kernels.md §1), unused by two-phase: */
    const real *const *bias;       /* NULL, or Q pointers: query q's bias of token n, source s at [n * bias_stride + s] */
    int64_t bias_stride;
    int normalize_values;          /* mix r_s v_s rather than v_s */
    real *const *weights, *const *logits; /* NULL, or Q pointers each: [n * stats_stride + s]; logits unbiased */
    int64_t stats_stride;
} multi_args;

static void multi_rows(const multi_args *a, int64_t begin, int64_t end) {
    const int64_t S = a->n_sources, D = a->d_model, Q = a->n_queries, P = a->prior_tokens;
    const real *const *src = a->sources;
    real rstd[S * TILE], w[Q * S * TILE], prior_weight[Q * TILE];
    for (int64_t t0 = begin; t0 < end; t0 += TILE) {
        const int64_t T = end - t0 < TILE ? end - t0 : TILE;
        /* pass 1: every row's square sum and its dots with every query, four source rows at a time (row_dots) */
        for (int64_t t = 0; t < T; ++t) {
            if (t0 + t + PREFETCH_ROWS < end) prefetch_rows(src, S, (t0 + t + PREFETCH_ROWS) * D, D);
            row_dots(src, S, D, t0 + t, t, a->queries, Q, NULL, 0, rstd, w, NULL);
        }
        /* statistics, across the tile's tokens: rstd once per source, then each query's softmax */
        for (int64_t s = 0; s < S; ++s) {
#pragma omp simd
            for (int64_t t = 0; t < T; ++t) rstd[s * TILE + t] = (real)1 / sqrt(rstd[s * TILE + t] / (real)D + a->eps);
        }
        for (int64_t q = 0; q < Q; ++q) {
            real *z = w + q * S * TILE, *e_prior = prior_weight + q * TILE;
            const real *prior_lse = a->prior_lse ? a->prior_lse + q * P : NULL;
            real max_logit[TILE], total[TILE];
            for (int64_t t = 0; t < T; ++t) max_logit[t] = prior_lse ? prior_lse[(t0 + t) % P] : -INFINITY;
            const real *bias = a->bias ? a->bias[q] : NULL;
            real *logits = a->logits ? a->logits[q] : NULL;
            for (int64_t s = 0; s < S; ++s) {
                if (bias || logits) { /* the routed op: report the unbiased logit, then add the bias */
                    for (int64_t t = 0; t < T; ++t) {
                        real logit = z[s * TILE + t] * rstd[s * TILE + t];
                        if (logits) logits[(t0 + t) * a->stats_stride + s] = logit;
                        if (bias) logit += bias[(t0 + t) * a->bias_stride + s];
                        z[s * TILE + t] = logit;
                        max_logit[t] = logit > max_logit[t] ? logit : max_logit[t];
                    }
                    continue;
                }
#pragma omp simd
                for (int64_t t = 0; t < T; ++t) {
                    z[s * TILE + t] *= rstd[s * TILE + t];
                    max_logit[t] = z[s * TILE + t] > max_logit[t] ? z[s * TILE + t] : max_logit[t];
                }
            }
            for (int64_t t = 0; t < T; ++t) {
                e_prior[t] = prior_lse ? exp_nonpositive(prior_lse[(t0 + t) % P] - max_logit[t]) : 0;
                total[t] = e_prior[t];
            }
            for (int64_t s = 0; s < S; ++s) {
#pragma omp simd
                for (int64_t t = 0; t < T; ++t) {
                    z[s * TILE + t] = exp_nonpositive(z[s * TILE + t] - max_logit[t]);
                    total[t] += z[s * TILE + t];
                }
            }
            for (int64_t t = 0; t < T; ++t) {
                a->lse[q][t0 + t] = max_logit[t] + log(total[t]);
                total[t] = (real)1 / total[t];
                e_prior[t] *= total[t];
            }
            for (int64_t s = 0; s < S; ++s) {
#pragma omp simd
                for (int64_t t = 0; t < T; ++t) z[s * TILE + t] *= total[t];
            }
            if (a->weights)
                for (int64_t s = 0; s < S; ++s)
                    for (int64_t t = 0; t < T; ++t) a->weights[q][(t0 + t) * a->stats_stride + s] = z[s * TILE + t];
            if (a->normalize_values) /* sum_s a_s (r_s v_s): the rstd joins the weight */
                for (int64_t s = 0; s < S; ++s) {
#pragma omp simd
                    for (int64_t t = 0; t < T; ++t) z[s * TILE + t] *= rstd[s * TILE + t];
                }
        }
        /* pass 2: each query's mix (mix_row), the rows still in L1/L2 */
        for (int64_t t = 0; t < T; ++t) {
            const int64_t row = (t0 + t) * D;
            for (int64_t q = 0; q < Q; ++q) {
                const real *alpha = w + q * S * TILE;
                real *h = a->mix[q] + (t0 + t) * a->mix_stride;
                const real *prior = a->prior_mix ? a->prior_mix + (q * P + (t0 + t) % P) * D : NULL;
                const real wp = prior_weight[q * TILE + t];
                if (prior) {
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) h[d] = wp * prior[d];
                } else {
                    for (int64_t d = 0; d < D; ++d) h[d] = 0;
                }
                mix_row(h, src, S, row, D, alpha + t);
            }
        }
    }
}

static void *multi_worker(void *arg) {
    const row_range *range = arg;
    multi_rows((const multi_args *)range->args, range->row_begin, range->row_end);
    return NULL;
}

void depth_attention_multi(const real *const *sources, int64_t n_sources, int64_t n_tokens, int64_t d_model,
                           const real *queries, int64_t n_queries, const real *prior_mix, const real *prior_lse,
                           int64_t prior_tokens, double eps, real *const *mix, real *const *lse, int n_threads) {
    /* cpu_depth.py never asks for these: it splits query sets and checks that P divides N */
    if (n_queries < 1 || n_queries > MAX_QUERIES || prior_tokens < 1 || n_tokens % prior_tokens != 0) return;
    const multi_args a = {.sources = sources, .n_sources = n_sources, .n_tokens = n_tokens, .d_model = d_model,
                          .n_queries = n_queries, .prior_tokens = prior_tokens, .queries = queries, .prior_mix = prior_mix,
                          .prior_lse = prior_lse, .eps = (real)eps, .mix = mix, .lse = lse, .mix_stride = d_model};
    run_rows(multi_worker, &a, n_tokens, n_threads);
}

/* The op with R routes over one source set (docs/kernels.md §1): depth_attention_multi without a prior, the queries
 * folded (u_r = c w_r g), with a token-major logit bias (NULL, or route r's at bias + r * bias_route_stride, token
 * n's row at n * bias_stride), values raw or normalised, h [N, R, D] and, where weights and logits are not NULL,
 * both [N, R, S] (logits unbiased). lse [R, N] is the backward's input. R <= MAX_QUERIES (cpu_depth.py splits). */
void depth_attention_routed(const real *const *sources, int64_t n_sources, int64_t n_tokens, int64_t d_model,
                            const real *queries, int64_t n_routes, const real *bias, int64_t bias_route_stride,
                            int64_t bias_stride, int normalize_values, double eps, real *h, real *lse, real *weights,
                            real *logits, int n_threads) {
    if (n_routes < 1 || n_routes > MAX_QUERIES || n_tokens < 1) return;
    real *mix_rows[MAX_QUERIES], *lse_rows[MAX_QUERIES], *weight_rows[MAX_QUERIES], *logit_rows[MAX_QUERIES];
    const real *bias_rows[MAX_QUERIES];
    for (int64_t r = 0; r < n_routes; ++r) {
        mix_rows[r] = h + r * d_model, lse_rows[r] = lse + r * n_tokens;
        weight_rows[r] = weights ? weights + r * n_sources : NULL, logit_rows[r] = logits ? logits + r * n_sources : NULL;
        bias_rows[r] = bias ? bias + r * bias_route_stride : NULL;
    }
    const multi_args a = {.sources = sources, .n_sources = n_sources, .n_tokens = n_tokens, .d_model = d_model,
                          .n_queries = n_routes, .prior_tokens = n_tokens, .queries = queries, .eps = (real)eps,
                          .mix = mix_rows, .lse = lse_rows, .mix_stride = n_routes * d_model,
                          .bias = bias ? bias_rows : NULL, .bias_stride = bias_stride,
                          .normalize_values = normalize_values, .weights = weights ? weight_rows : NULL,
                          .logits = logits ? logit_rows : NULL, .stats_stride = n_routes * n_sources};
    run_rows(multi_worker, &a, n_tokens, n_threads);
}

/* The backward of depth_attention_multi with P = N (training's two-phase Full AttnRes: phase 1 with Q queries and
 * no prior, phase 2 with Q = 1 and phase 1's part as its prior; docs/kernels.md §7). Per token and query q, with
 * r_s the rstd of source v_s, z_qs = r_s (u_q . v_s), the forward's lse_q, the weights a_qs = exp(z_qs - lse_q)
 * and a_qp = exp(l_q - lse_q) of the prior (m_q, l_q), and the output gradients dh_q and dlse_q (either may be
 * absent: zero):
 *   c_q    = dh_q . h_q - dlse_q = sum_s a_qs (dh_q . v_s) + a_qp (dh_q . m_q) - dlse_q
 *   dz_qs  = a_qs (dh_q . v_s - c_q)
 *   dv_s   = sum_q (a_qs dh_q + dz_qs r_s u_q) - (r_s^2 / D) (sum_q dz_qs z_qs) v_s
 *   du_q  += sum_s dz_qs r_s v_s
 *   dm_q   = a_qp dh_q,   dl_q = a_qp (dh_q . m_q - c_q)
 * In tiles of TILE tokens: pass 1 reads each source's TILE rows (a contiguous block) for their square sums and
 * dots with every u_q and dh_q, GROUP at a time; pass 2 reads them again, from L1/L2, for the gradients. So each
 * source is read from memory once for all Q consumers, where Q one-pass backwards read it Q times. dv_s is written,
 * or added where accumulate[s] (a source whose consumers sum their gradients in one buffer, docs/kernels.md §5). */
typedef struct {
    const real *const *sources;
    int64_t n_sources, n_tokens, d_model, n_queries;
    const real *queries, *prior_mix, *prior_lse;              /* [Q, D], [Q, N, D], [Q, N] */
    const real *const *lse;                                    /* Q pointers to the forward's [N] outputs */
    real eps;
    const real *const *grad_mix, *const *grad_lse;             /* Q pointers each ([N, D], [N]); entries may be NULL */
    real *const *grad_sources;
    const uint8_t *accumulate;
    real *grad_query_partial;                                  /* [threads, Q, D] */
    real *grad_prior_mix, *grad_prior_lse;                     /* [Q, N, D], [Q, N]; NULL without a prior */
    int64_t grad_mix_stride;                                   /* from one token's dh_q row to the next */
    const real *const *bias;                                   /* as multi_args' (the routed op) */
    int64_t bias_stride;
    int normalize_values;
} multi_grad_args;

/* dv for one source row and Q <= 4 queries in one pass over d (Q a constant where inlined, so the query loop
 * unrolls): dv = kept - coef v + sum_q (weight_q dh_q + key_coef_q u_q), and du_q += key_coef_q v. A query
 * without dh has weight 0 and any readable row as dh. */
INLINE void gradient_row(real *restrict grad, const real *restrict v, int keep, real coef, const int Q,
                         const real *weight, const real *key_coef, const real *const *dh, const real *restrict u,
                         real *restrict grad_u, int64_t D) {
    const real w0 = weight[0], w1 = Q > 1 ? weight[1] : 0, w2 = Q > 2 ? weight[2] : 0, w3 = Q > 3 ? weight[3] : 0;
    const real k0 = key_coef[0], k1 = Q > 1 ? key_coef[1] : 0, k2 = Q > 2 ? key_coef[2] : 0,
               k3 = Q > 3 ? key_coef[3] : 0;
    const real *restrict h0 = dh[0], *restrict h1 = Q > 1 ? dh[1] : v, *restrict h2 = Q > 2 ? dh[2] : v,
               *restrict h3 = Q > 3 ? dh[3] : v;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
        const real x = v[d];
        real total = (keep ? grad[d] : 0) - coef * x + w0 * h0[d] + k0 * u[d];
        grad_u[d] += k0 * x;
        if (Q > 1) total += w1 * h1[d] + k1 * u[D + d], grad_u[D + d] += k1 * x;
        if (Q > 2) total += w2 * h2[d] + k2 * u[2 * D + d], grad_u[2 * D + d] += k2 * x;
        if (Q > 3) total += w3 * h3[d] + k3 * u[3 * D + d], grad_u[3 * D + d] += k3 * x;
        grad[d] = total;
    }
}

/* gradient_row for four source rows of one token at once: each query's dh, u and du rows are loaded once for the
 * four (one row at a time, the loads and stores of those rows outnumbered the FMAs). weight and key_coef are
 * [4 queries][4 sources]. */
INLINE void gradient_rows4(real *const *grad, const real *const *v, const int *keep, const real *coef, const int Q,
                           const real *weight, const real *key_coef, const real *const *dh, const real *restrict u,
                           real *restrict grad_u, int64_t D) {
    real *restrict g0 = grad[0], *restrict g1 = grad[1], *restrict g2 = grad[2], *restrict g3 = grad[3];
    const real *restrict v0 = v[0], *restrict v1 = v[1], *restrict v2 = v[2], *restrict v3 = v[3];
    const real *restrict h0 = dh[0], *restrict h1 = Q > 1 ? dh[1] : v0, *restrict h2 = Q > 2 ? dh[2] : v0,
               *restrict h3 = Q > 3 ? dh[3] : v0;
    const int keep0 = keep[0], keep1 = keep[1], keep2 = keep[2], keep3 = keep[3];
    const real c0 = coef[0], c1 = coef[1], c2 = coef[2], c3 = coef[3];
#define QUERY_TERMS(q, h)                                                                                      \
    if (Q > q) {                                                                                               \
        const real hd = h[d], ud = u[q * D + d];                                                               \
        t0 += weight[4 * q] * hd + key_coef[4 * q] * ud, t1 += weight[4 * q + 1] * hd + key_coef[4 * q + 1] * ud; \
        t2 += weight[4 * q + 2] * hd + key_coef[4 * q + 2] * ud;                                               \
        t3 += weight[4 * q + 3] * hd + key_coef[4 * q + 3] * ud;                                               \
        grad_u[q * D + d] += key_coef[4 * q] * x0 + key_coef[4 * q + 1] * x1 + key_coef[4 * q + 2] * x2          \
                             + key_coef[4 * q + 3] * x3;                                                       \
    }
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
        const real x0 = v0[d], x1 = v1[d], x2 = v2[d], x3 = v3[d];
        real t0 = (keep0 ? g0[d] : 0) - c0 * x0, t1 = (keep1 ? g1[d] : 0) - c1 * x1,
             t2 = (keep2 ? g2[d] : 0) - c2 * x2, t3 = (keep3 ? g3[d] : 0) - c3 * x3;
        QUERY_TERMS(0, h0)
        QUERY_TERMS(1, h1)
        QUERY_TERMS(2, h2)
        QUERY_TERMS(3, h3)
        g0[d] = t0, g1[d] = t1, g2[d] = t2, g3[d] = t3;
    }
#undef QUERY_TERMS
}

/* Pass 2 for one token row of every source and the queries q0 .. q0 + Q - 1, Q <= 4 (a constant where inlined):
 * four sources at a time, then the rest one by one. z holds the weights a_qs, g the key coefficients dz_qs r_s
 * ([Q, S, TILE], token t). The first chunk of queries writes each gradient (or adds, for a shared buffer) with the
 * value term; later chunks add their queries' terms. */
INLINE void gradient_rows_q(const multi_grad_args *a, int64_t n, int64_t t, const real *z, const real *g,
                            const real *value_coef, real *grad_u, const int64_t q0, const int Q) {
    const int64_t S = a->n_sources, D = a->d_model;
    const int first = q0 == 0;
    const real *dh[4], *u = a->queries + q0 * D;
    for (int64_t q = 0; q < Q; ++q)
        dh[q] = a->grad_mix[q0 + q] ? a->grad_mix[q0 + q] + n * a->grad_mix_stride : a->sources[0] + n * D;
    int64_t s = 0;
    for (; s + GROUP <= S; s += GROUP) {
        real weight[16], key_coef[16], coef[GROUP], *grad[GROUP];
        const real *v[GROUP];
        int keep[GROUP];
        for (int i = 0; i < GROUP; ++i) {
            v[i] = a->sources[s + i] + n * D, grad[i] = a->grad_sources[s + i] + n * D;
            keep[i] = !first || (a->accumulate && a->accumulate[s + i]);
            coef[i] = first ? value_coef[(s + i) * TILE + t] : 0;
            for (int64_t q = 0; q < Q; ++q) {
                const int64_t k = ((q0 + q) * S + s + i) * TILE + t;
                weight[4 * q + i] = a->grad_mix[q0 + q] ? z[k] : 0, key_coef[4 * q + i] = g[k];
            }
        }
        gradient_rows4(grad, v, keep, coef, Q, weight, key_coef, dh, u, grad_u + q0 * D, D);
    }
    for (; s < S; ++s) {
        real weight[4], key_coef[4];
        for (int64_t q = 0; q < Q; ++q) {
            const int64_t k = ((q0 + q) * S + s) * TILE + t;
            weight[q] = a->grad_mix[q0 + q] ? z[k] : 0, key_coef[q] = g[k];
        }
        gradient_row(a->grad_sources[s] + n * D, a->sources[s] + n * D,
                     !first || (a->accumulate && a->accumulate[s]), first ? value_coef[s * TILE + t] : 0, Q, weight,
                     key_coef, dh, u, grad_u + q0 * D, D);
    }
}

static void multi_backward_rows(const multi_grad_args *a, int64_t begin, int64_t end, real *grad_u) {
    const int64_t S = a->n_sources, N = a->n_tokens, D = a->d_model, Q = a->n_queries;
    /* per (q, s, token): z (u_q . v_s, the logit, then the weight a_qs) and g (dh_q . v_s, then dz_qs r_s); per
     * (q, token): c_q, and the prior's weight and dh_q . m_q */
    real rstd[S * TILE], z[Q * S * TILE], g[Q * S * TILE], value_coef[S * TILE];
    real c[Q * TILE], prior_weight[Q * TILE], prior_dot[Q * TILE];
    for (int64_t t0 = begin; t0 < end; t0 += TILE) {
        const int64_t T = end - t0 < TILE ? end - t0 : TILE;
        /* pass 1: the tile's rows, token by token (S streams at once, as the forward's row order) */
        for (int64_t t = 0; t < T; ++t)
            row_dots(a->sources, S, D, t0 + t, t, a->queries, Q, a->grad_mix, a->grad_mix_stride, rstd, z, g);
        for (int64_t q = 0; q < Q; ++q)
            for (int64_t t = 0; t < T; ++t) {
                const int64_t n = t0 + t;
                const real *dh = a->grad_mix[q] ? a->grad_mix[q] + n * a->grad_mix_stride : NULL;
                real dot = 0, weight = 0;
                if (a->prior_mix) {
                    const real *m = a->prior_mix + (q * N + n) * D;
                    weight = exp_nonpositive(a->prior_lse[q * N + n] - a->lse[q][n]);
                    if (dh) {
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < D; ++d) dot += dh[d] * m[d];
                    }
                }
                prior_weight[q * TILE + t] = weight, prior_dot[q * TILE + t] = dot;
                /* c_q = dh_q . h_q - dlse_q, with dh_q . h_q the weighted sum of the parts' dots: h_q itself is
                 * not kept (a consumer may edit its input in place) */
                c[q * TILE + t] = weight * dot - (a->grad_lse[q] ? a->grad_lse[q][n] : 0);
            }
        /* statistics, across the tile's tokens: the logits and c, then each weight and its dz */
        for (int64_t s = 0; s < S; ++s) {
            real *r = rstd + s * TILE;
#pragma omp simd
            for (int64_t t = 0; t < T; ++t) r[t] = (real)1 / sqrt(r[t] / (real)D + a->eps);
            for (int64_t q = 0; q < Q; ++q) {
                real *zq = z + (q * S + s) * TILE, *cq = c + q * TILE;
                const real *gq = g + (q * S + s) * TILE, *lse = a->lse[q] + t0;
                const real *bias = a->bias ? a->bias[q] + t0 * a->bias_stride + s : NULL;
                if (bias || a->normalize_values) { /* the routed op: p_qs = dh_q . v^_s, the weight biased */
                    for (int64_t t = 0; t < T; ++t) {
                        zq[t] *= r[t];
                        const real weight = exp_nonpositive(zq[t] + (bias ? bias[t * a->bias_stride] : 0) - lse[t]);
                        cq[t] += weight * (a->normalize_values ? gq[t] * r[t] : gq[t]);
                    }
                    continue;
                }
#pragma omp simd
                for (int64_t t = 0; t < T; ++t) {
                    zq[t] *= r[t];
                    cq[t] += exp_nonpositive(zq[t] - lse[t]) * gq[t];
                }
            }
        }
        for (int64_t s = 0; s < S; ++s) {
            real *r = rstd + s * TILE, *coef = value_coef + s * TILE;
            for (int64_t t = 0; t < T; ++t) coef[t] = 0;
            for (int64_t q = 0; q < Q; ++q) {
                real *zq = z + (q * S + s) * TILE, *gq = g + (q * S + s) * TILE;
                const real *lse = a->lse[q] + t0, *cq = c + q * TILE;
                const real *bias = a->bias ? a->bias[q] + t0 * a->bias_stride + s : NULL;
                if (bias || a->normalize_values) { /* normalised values: docs/kernels.md §5's extra terms */
                    const int normalized = a->normalize_values;
                    for (int64_t t = 0; t < T; ++t) {
                        const real logit = zq[t], weight = exp_nonpositive(logit + (bias ? bias[t * a->bias_stride] : 0) - lse[t]);
                        const real dot = normalized ? gq[t] * r[t] : gq[t], dlogit = weight * (dot - cq[t]);
                        coef[t] += dlogit * logit + (normalized ? weight * dot : 0);
                        zq[t] = normalized ? weight * r[t] : weight; /* the weight of dh_q in dv_s */
                        gq[t] = dlogit * r[t];
                    }
                    continue;
                }
#pragma omp simd
                for (int64_t t = 0; t < T; ++t) {
                    const real logit = zq[t], weight = exp_nonpositive(logit - lse[t]);
                    const real dlogit = weight * (gq[t] - cq[t]);
                    coef[t] += dlogit * logit;
                    zq[t] = weight;
                    gq[t] = dlogit * r[t];
                }
            }
#pragma omp simd
            for (int64_t t = 0; t < T; ++t) coef[t] *= r[t] * r[t] / (real)D;
        }
        if (a->prior_mix) /* the prior's gradients */
            for (int64_t q = 0; q < Q; ++q)
                for (int64_t t = 0; t < T; ++t) {
                    const int64_t n = t0 + t, row = (q * N + n) * D, i = q * TILE + t;
                    const real *dh = a->grad_mix[q] ? a->grad_mix[q] + n * a->grad_mix_stride : NULL,
                               weight = prior_weight[i];
                    real *dm = a->grad_prior_mix + row;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) dm[d] = dh ? weight * dh[d] : 0;
                    a->grad_prior_lse[q * N + n] = weight * (prior_dot[i] - c[i]);
                }
        /* pass 2: the sources' gradients and du, token by token, the rows still in L1/L2; up to four queries a
         * sweep (5..MAX_QUERIES take two) */
        for (int64_t t = 0; t < T; ++t)
            for (int64_t q0 = 0; q0 < Q; q0 += 4) {
                switch (Q - q0 < 4 ? Q - q0 : 4) {
                case 1: gradient_rows_q(a, t0 + t, t, z, g, value_coef, grad_u, q0, 1); break;
                case 2: gradient_rows_q(a, t0 + t, t, z, g, value_coef, grad_u, q0, 2); break;
                case 3: gradient_rows_q(a, t0 + t, t, z, g, value_coef, grad_u, q0, 3); break;
                default: gradient_rows_q(a, t0 + t, t, z, g, value_coef, grad_u, q0, 4);
                }
            }
    }
}

static void *multi_backward_worker(void *arg) {
    const row_range *range = arg;
    const multi_grad_args *a = (const multi_grad_args *)range->args;
    const size_t bytes = (size_t)(a->n_queries * a->d_model) * sizeof(real);
    real *row = a->grad_query_partial + range->thread * a->n_queries * a->d_model;
    real *grad_u = thread_sums(row, bytes);
    multi_backward_rows(a, range->row_begin, range->row_end, grad_u);
    release_thread_sums(grad_u, row, bytes);
    return NULL;
}

/* grad_queries [Q, D] gets du_q (the threads' sums added in thread order); grad_prior_mix and grad_prior_lse are
 * written where prior_mix is given. Returns 0, -1 when the threads' sums cannot be allocated (nothing written), -2
 * for a query count outside 1..MAX_QUERIES (cpu_depth.py splits larger sets). */
/* Runs a multi backward over the threads, each summing its du into its own row of a [threads, Q, D] buffer, and
 * adds those rows in thread order into grad_queries. Returns 0, or -1 when the buffer cannot be allocated. */
static int multi_backward_run(multi_grad_args *a, real *grad_queries, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    const int64_t width = a->n_queries * a->d_model;
    real *sums = malloc((size_t)(n_threads * width) * sizeof(real));
    if (sums == NULL) return -1;
    a->grad_query_partial = sums;
    run_rows(multi_backward_worker, a, a->n_tokens, n_threads);
    for (int64_t i = 0; i < width; ++i) {
        real total = 0;
        for (int t = 0; t < n_threads; ++t) total += sums[t * width + i];
        grad_queries[i] = total;
    }
    free(sums);
    return 0;
}

int depth_attention_multi_backward(const real *const *sources, int64_t n_sources, int64_t n_tokens, int64_t d_model,
                                   const real *queries, int64_t n_queries, const real *prior_mix,
                                   const real *prior_lse, double eps, const real *const *lse,
                                   const real *const *grad_mix, const real *const *grad_lse,
                                   real *const *grad_sources, const uint8_t *accumulate, real *grad_queries,
                                   real *grad_prior_mix, real *grad_prior_lse, int n_threads) {
    if (n_queries < 1 || n_queries > MAX_QUERIES) return -2;
    multi_grad_args a = {.sources = sources, .n_sources = n_sources, .n_tokens = n_tokens,
                         .d_model = d_model, .n_queries = n_queries, .queries = queries,
                         .prior_mix = prior_mix, .prior_lse = prior_lse, .lse = lse,
                         .eps = (real)eps, .grad_mix = grad_mix, .grad_lse = grad_lse,
                         .grad_sources = grad_sources, .accumulate = accumulate,
                         .grad_prior_mix = grad_prior_mix, .grad_prior_lse = grad_prior_lse,
                         .grad_mix_stride = d_model};
    return multi_backward_run(&a, grad_queries, n_threads);
}

/* The backward of depth_attention_routed: grad_h [N, R, D] (token-major, as h), lse [R, N] and the bias as the
 * forward had them; grad_queries [R, D] gets du_r. Returns as depth_attention_multi_backward. */
int depth_attention_routed_backward(const real *const *sources, int64_t n_sources, int64_t n_tokens, int64_t d_model,
                                    const real *queries, int64_t n_routes, const real *bias, int64_t bias_route_stride,
                                    int64_t bias_stride, int normalize_values, double eps, const real *lse,
                                    const real *grad_h, real *const *grad_sources, const uint8_t *accumulate,
                                    real *grad_queries, int n_threads) {
    if (n_routes < 1 || n_routes > MAX_QUERIES) return -2;
    const real *lse_rows[MAX_QUERIES], *grad_rows[MAX_QUERIES], *bias_rows[MAX_QUERIES];
    const real *no_grad_lse[MAX_QUERIES] = {NULL};
    for (int64_t r = 0; r < n_routes; ++r) {
        lse_rows[r] = lse + r * n_tokens, grad_rows[r] = grad_h + r * d_model;
        bias_rows[r] = bias ? bias + r * bias_route_stride : NULL;
    }
    multi_grad_args a = {.sources = sources, .n_sources = n_sources, .n_tokens = n_tokens,
                         .d_model = d_model, .n_queries = n_routes, .queries = queries, .lse = lse_rows,
                         .eps = (real)eps, .grad_mix = grad_rows, .grad_lse = no_grad_lse,
                         .grad_sources = grad_sources, .accumulate = accumulate,
                         .grad_mix_stride = n_routes * d_model, .bias = bias ? bias_rows : NULL,
                         .bias_stride = bias_stride, .normalize_values = normalize_values};
    return multi_backward_run(&a, grad_queries, n_threads);
}
