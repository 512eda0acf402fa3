/* The C kernels' shared private header: the element type, the vector sums, and the helpers more than one kernel file
 * inlines (the softmax's exp, an RMSNorm row, a thread's own sums). The kernel files (cpu_build.c, cpu_depth.c,
 * cpu_elementwise.c, cpu_attention.c) are compiled together into one shared library by cpu_build.py, once per
 * element type, with -DREAL=float or -DREAL=double; every helper here is static, so each file inlines its own copy
 * and the code each kernel runs is what it was in one file.
 */
#ifndef ATTNRES_LENS_CPU_KERNELS_H
#define ATTNRES_LENS_CPU_KERNELS_H

#include <pthread.h>
#include <stdint.h>
#ifdef _OPENMP
/* Only GCC's OpenMP runtime is torch's (libgomp, docs/kernels.md §6): clang's -fopenmp links LLVM's libomp, a second
 * pool competing for the cores, so a clang build takes the pthread form (the build without -fopenmp follows). */
#if defined(__clang__)
#error "the OpenMP form of this kernel needs GCC's libgomp; clang builds the pthread form"
#endif
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <tgmath.h> /* sqrt/exp in the element type, not double */

#ifndef REAL
#error "compile with -DREAL=float or -DREAL=double"
#endif
typedef REAL real;

#define MAX_THREADS 64 /* cpu_build.py caps its thread count at the same number */
#define INLINE static inline __attribute__((always_inline))

/* The float build on a processor with AVX2 and FMA (-march=native) sums the lanes of four vector accumulators at
 * once (three horizontal adds): the compiler's own lowering of a `omp simd` reduction stores each accumulator and
 * adds its eight lanes one after the other, which at d_model 64 cost about as much as the row's FMAs (perf,
 * docs/kernels.md §6). The same sums, in another order; the double build keeps the portable loops, and so does
 * -DNO_VECTOR_SUMS (analyses/bench_cpu_kernels.py's baseline). */
#define FLOAT_BUILD_float 1
#define PASTE(a, b) a##b
#define EXPAND_PASTE(a, b) PASTE(a, b)
#if defined(__AVX2__) && defined(__FMA__) && EXPAND_PASTE(FLOAT_BUILD_, REAL) && !defined(NO_VECTOR_SUMS)
#define VECTOR_SUMS 1
#include <immintrin.h>

/* [lane sum of a0, of a1, of a2, of a3] */
INLINE __m128 lane_sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#else
#define VECTOR_SUMS 0
#endif

/* exp(x) for x <= 0 (a softmax's logit minus its maximum) in the float build, in a form the compiler vectorises
 * across tokens: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (truncation < 1e-8, below
 * half an ulp), times 2^n built in the exponent bits; exp(x) < 2^-126 (x < -87.34, a -inf bias included) gives 0.
 * Token by token, libm's scalar expf with the other statistics cost more than the row sums (docs/kernels.md §6).
 * NaN stays NaN.
 * The double build (tests, float64 oracles) keeps libm's exp. */
INLINE real exp_nonpositive(real x) {
    if (sizeof(real) != sizeof(float)) return exp(x);
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits */
    const float shifted = fmaf((float)x, 1.44269504088896341f, magic);
    const float n = shifted - magic;
    /* x - n ln2, the exact high part of ln2 first (n * hi has no rounding error for |n| < 512), then the rest */
    const float r = fmaf(n, -1.428606765330187e-06f, fmaf(n, -0.693145751953125f, (float)x));
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    uint32_t bits; /* unsigned: the shift is defined for every input, NaN and the zeroed range included */
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits - 0x4B400000u + 127u) << 23; /* 0x4B400000: the bits of magic, so this is (n + 127) << 23 */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return (float)x < -87.33654475f ? 0.0f : p * scale; /* below ln(2^-126) e^x is not a normal float */
}

#if VECTOR_SUMS
/* exp_nonpositive on eight lanes: the same operations in the same order, so the same bits */
INLINE __m256 exp_nonpositive8(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 shifted = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic);
    const __m256 n = _mm256_sub_ps(shifted, magic);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187e-06f),
                                     _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x));
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(0x4B400000)),
                         _mm256_set1_epi32(127)), 23);
    /* not (x < ln 2^-126): NaN keeps its NaN, as the scalar form's comparison does */
    const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654475f), _CMP_NLT_UQ);
    return _mm256_and_ps(normal, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

/* RMSNorm of one row (docs/model.md §6): r = 1 / sqrt(mean(x^2) + eps), y = x r w; returns r */
INLINE real norm_row(const real *x, const real *w, int64_t D, real eps, real *y) {
    real square = 0;
#pragma omp simd reduction(+ : square)
    for (int64_t d = 0; d < D; ++d) square += x[d] * x[d];
    const real r = (real)1 / sqrt(square / (real)D + eps);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] = x[d] * r * w[d];
    return r;
}

/* Its backward for the output gradient g: dx = r (g w) - x r^3 / D * sum_d (g w x) (plus `extra`, the input's
 * gradient from elsewhere, when not NULL); dw += g x r, summed over rows in double */
INLINE void norm_row_backward(const real *x, const real *w, real r, const real *g, const real *extra, int64_t D,
                              real *dx, double *grad_w) {
    real dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += g[d] * w[d] * x[d];
    const real coefficient = dot * r * r * r / (real)D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
        dx[d] = r * g[d] * w[d] - coefficient * x[d] + (extra ? extra[d] : 0);
        grad_w[d] += (double)(g[d] * x[d] * r);
    }
}

/* A thread's running sums over its rows (a parameter's gradient), zeroed, in memory of its own: whole pages from the
 * heap, which the thread adds into row after row and copies into its row of the caller's [threads, n] block once at
 * the end (`release_thread_sums`). Added into that block in place, the rows of two threads lie side by side, and
 * the second thread's half of a depth-mix backward took much longer than the first's when both ran (each alone
 * took the same), so two threads gained far less than half the time (docs/kernels.md §11). NULL if the
 * pages cannot be had, and always with -DSHARED_THREAD_SUMS (analyses/bench_cpu_kernels.py's baseline, and the
 * tests' check of this path): the caller then adds into its row in place (slower, the same sums). */
static inline void *own_thread_sums(size_t bytes) {
#ifdef SHARED_THREAD_SUMS
    (void)bytes;
    return NULL;
#else
    const size_t page = 4096;
    void *sums = aligned_alloc(page, (bytes + page - 1) / page * page);
    if (sums != NULL) memset(sums, 0, bytes);
    return sums;
#endif
}

/* Where a thread adds its sums: its own pages, or `row` (zeroed here) when they cannot be had. */
static inline void *thread_sums(void *row, size_t bytes) {
    void *own = own_thread_sums(bytes);
    if (own != NULL) return own;
    memset(row, 0, bytes);
    return row;
}

/* Copies a thread's sums into its row of the caller's block and frees its pages (nothing when it added in place). */
static inline void release_thread_sums(void *sums, void *row, size_t bytes) {
    if (sums == row) return;
    memcpy(row, sums, bytes);
    free(sums);
}

#endif
