/* The elementwise kernels of a layer: the KV token shift (docs/model.md §5; readable twin: layer_ops.TokenShiftMix),
 * optionally with K's rotary embedding, the rotary embedding (docs/model.md §6; twin: layer_ops.apply_rotary) and
 * RMSNorm (twin: components.RMSNorm), each one pass over its tensor each way; wrapped by cpu_elementwise.py. */
#include "cpu_kernels.h"

/* The elementwise kernels below (KV shift, rotary, RMSNorm) split their rows over n_threads of torch's OpenMP pool
 * in the OpenMP build (docs/kernels.md §6), each thread a contiguous range of rows as `schedule(static)` deals them;
 * the pthread build runs them on the calling thread (a thread started per call costs more than these passes). A
 * sum over rows (a parameter's gradient) is summed per thread, in double, and the threads' sums are added in
 * thread order: deterministic for a given thread count, and on one thread the same sums as a plain loop. */
#ifdef _OPENMP
#define THREAD_INDEX omp_get_thread_num()
#define THREAD_COUNT omp_get_num_threads()
#else
#define THREAD_INDEX 0
#define THREAD_COUNT 1
#endif

/* KV token shift, x [B, P, H, Dh] contiguous; per head h the pair (c1, c2) = coefficients[h * stride + {0, 1}]
 * (a layer's [H, 4] parameter holds K's pair and V's side by side, so both read it in place):
 *   y_t = c1 x_t + c2 x_{t-1}   (x_{-1} = 0)
 * Backward for the output gradient dy (sums over batch, position and d_head, per head; written with the same
 * stride):
 *   dx_t = c1 dy_t + c2 dy_{t+1}   (dy_P = 0),   dc1 = sum dy_t . x_t,   dc2 = sum dy_t . x_{t-1}
 * One pass over x each way (and dy in the backward), where PyTorch ops take one pass per product and sum. Each
 * row's dots run in the element type, their sum over rows in double.
 * With rotary tables (cos_table not NULL; the layout of rotary_forward below), K's rotary embedding is applied in
 * the same pass: y_t = R_t (c1 x_t + c2 x_{t-1}), each row rotated in L1 after it is mixed, and the backward first
 * rotates dy_t and dy_{t+1} back (R_t^T, the rotation by minus the angle) and then runs the shift's backward on
 * them. A separate rotary call reads and writes K once more each way (docs/kernels.md §2). */
/* One head's row of rotary_forward (below): y = the rotation of x's pairs by sign x the angles; y may be x */
INLINE void rotate_row(const real *x, real *y, const real *c, const real *s, int64_t half, real sign) {
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
        const real x1 = x[d], x2 = x[d + half], sd = sign * s[d];
        y[d] = x1 * c[d] - x2 * sd;
        y[d + half] = x2 * c[d] + x1 * sd;
    }
}

void token_shift_forward(const real *x, const real *coefficients, int64_t stride, int64_t B, int64_t P, int64_t H,
                         int64_t Dh, const real *cos_table, const real *sin_table, int64_t table_stride, real *y,
                         int n_threads) {
    const int64_t row = H * Dh;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t r = 0; r < B * P; ++r) {
        const int64_t t = r % P, offset = r * row;
        for (int64_t h = 0; h < H; ++h) {
            const real c1 = coefficients[h * stride], c2 = coefficients[h * stride + 1];
            const real *now = x + offset + h * Dh, *before = t > 0 ? now - row : now;
            real *out = y + offset + h * Dh;
            if (t == 0) {
#pragma omp simd
                for (int64_t d = 0; d < Dh; ++d) out[d] = c1 * now[d];
            } else {
#pragma omp simd
                for (int64_t d = 0; d < Dh; ++d) out[d] = c1 * now[d] + c2 * before[d];
            }
            if (cos_table) rotate_row(out, out, cos_table + t * table_stride, sin_table + t * table_stride, Dh / 2, 1);
        }
    }
}

/* dy_t (position t of row r's head h) rotated back into `into` where the forward rotated, else dy_t in place */
INLINE const real *unrotated(const real *dy, int64_t t, int64_t Dh, const real *cos_table, const real *sin_table,
                             int64_t table_stride, real *into) {
    if (!cos_table) return dy;
    rotate_row(dy, into, cos_table + t * table_stride, sin_table + t * table_stride, Dh / 2, -1);
    return into;
}

void token_shift_backward(const real *x, const real *coefficients, int64_t stride, const real *grad_y, int64_t B,
                          int64_t P, int64_t H, int64_t Dh, const real *cos_table, const real *sin_table,
                          int64_t table_stride, real *grad_x, real *grad_coefficients, int n_threads) {
    const int64_t row = H * Dh;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    double sums[n_threads * 2 * H]; /* per thread: (dc1, dc2) of every head */
    int used = 1;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        double *slot = sums + THREAD_INDEX * 2 * H, *mine = thread_sums(slot, (size_t)(2 * H) * sizeof(double));
        real now_rows[cos_table ? Dh : 1], next_rows[cos_table ? Dh : 1]; /* dy_t, dy_{t+1} rotated back */
#pragma omp single
        used = THREAD_COUNT;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * P; ++r) {
            const int64_t t = r % P, offset = r * row;
            for (int64_t h = 0; h < H; ++h) {
                const real c1 = coefficients[h * stride], c2 = coefficients[h * stride + 1];
                const real *dy = unrotated(grad_y + offset + h * Dh, t, Dh, cos_table, sin_table, table_stride,
                                           now_rows);
                const real *dy_next = t + 1 < P ? unrotated(grad_y + offset + row + h * Dh, t + 1, Dh, cos_table,
                                                            sin_table, table_stride, next_rows)
                                                : dy;
                const real *now = x + offset + h * Dh, *before = t > 0 ? now - row : now;
                real *dx = grad_x + offset + h * Dh;
                real current = 0, previous = 0;
                if (t + 1 < P) {
#pragma omp simd reduction(+ : current)
                    for (int64_t d = 0; d < Dh; ++d) {
                        dx[d] = c1 * dy[d] + c2 * dy_next[d];
                        current += dy[d] * now[d];
                    }
                } else {
#pragma omp simd reduction(+ : current)
                    for (int64_t d = 0; d < Dh; ++d) {
                        dx[d] = c1 * dy[d];
                        current += dy[d] * now[d];
                    }
                }
                if (t > 0) {
#pragma omp simd reduction(+ : previous)
                    for (int64_t d = 0; d < Dh; ++d) previous += dy[d] * before[d];
                }
                mine[2 * h] += current;
                mine[2 * h + 1] += previous;
            }
        }
        release_thread_sums(mine, slot, (size_t)(2 * H) * sizeof(double));
    }
    for (int64_t h = 0; h < H; ++h) {
        double current = 0, previous = 0;
        for (int thread = 0; thread < used; ++thread)
            current += sums[thread * 2 * H + 2 * h], previous += sums[thread * 2 * H + 2 * h + 1];
        grad_coefficients[h * stride] = (real)current;
        grad_coefficients[h * stride + 1] = (real)previous;
    }
}

/* Rotate-half rotary embedding (docs/model.md §6; readable twin: layer_ops.apply_rotary) of x [B, P, H, Dh]
 * contiguous, Dh even, with half = Dh / 2 and per position t the angles' cos c and sin s ([P, ·] tables with row
 * stride `table_stride`; the first half of a row is read, rotary_tables repeats it in the second):
 *   y_d = x_d c_d - x_{d+half} s_d,   y_{d+half} = x_{d+half} c_d + x_d s_d        (d < half)
 * The map is a rotation of each pair (x_d, x_{d+half}) by the angle, so its backward is the rotation by minus the
 * angle: the same rotate_row with `sign` = -1 on the output gradient. One pass over x, where the PyTorch form makes
 * three (x * cos, roll, addcmul). */
void rotary_forward(const real *x, const real *cos_table, const real *sin_table, int64_t table_stride, int64_t B,
                    int64_t P, int64_t H, int64_t Dh, double sign, real *y, int n_threads) {
    const int64_t half = Dh / 2;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t r = 0; r < B * P; ++r) {
        const int64_t t = r % P;
        const real *c = cos_table + t * table_stride, *s = sin_table + t * table_stride;
        for (int64_t h = 0; h < H; ++h) {
            const int64_t offset = (r * H + h) * Dh;
            rotate_row(x + offset, y + offset, c, s, half, (real)sign);
        }
    }
}

/* RMSNorm (docs/model.md §6; readable twin: components.RMSNorm's hooked path) of N rows of D, gain w:
 *   r = 1 / sqrt(mean(x^2) + eps),   y = x r w
 * Backward for the output gradient g (per row; dw sums over rows, in double):
 *   dx = r (g w) - x r^3 / D * sum_d (g w x),   dw = sum_rows g x r
 * One pass over x forward (r kept for the backward), one over x and g back, where PyTorch's CPU rms_norm takes
 * six (pow, mean, add, rsqrt, two products). The backward's per-thread sums of dw are [threads, D] in double on
 * the heap (D may be large). Returns 0, or -1 where that buffer could not be allocated (nothing written). */
void rms_norm_forward(const real *x, const real *w, int64_t N, int64_t D, double eps, real *y, real *rstd,
                      int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t n = 0; n < N; ++n) rstd[n] = norm_row(x + n * D, w, D, (real)eps, y + n * D);
}

int rms_norm_backward(const real *x, const real *w, const real *rstd, const real *grad_y, int64_t N, int64_t D,
                      real *grad_x, real *grad_w, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    double *sums = calloc((size_t)n_threads * (size_t)D, sizeof(double));
    if (sums == NULL) return -1;
    int used = 1;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1)
    {
        double *slot = sums + THREAD_INDEX * D, *mine = thread_sums(slot, (size_t)D * sizeof(double));
#pragma omp single
        used = THREAD_COUNT;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n)
            norm_row_backward(x + n * D, w, rstd[n], grad_y + n * D, NULL, D, grad_x + n * D, mine);
        release_thread_sums(mine, slot, (size_t)D * sizeof(double));
    }
    for (int64_t d = 0; d < D; ++d) {
        double total = 0;
        for (int thread = 0; thread < used; ++thread) total += sums[thread * D + d];
        grad_w[d] = (real)total;
    }
    free(sums);
    return 0;
}

