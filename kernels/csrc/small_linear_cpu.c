/* y = x W^T (+ b) for a few rows of x, float32: the decode GEMM at low batch.
 *
 * With 1-8 rows a linear layer is a stream over its weight: every weight element is used
 * once per row. oneDNN's and MKL's GEMMs reach a third to a half of the streaming read
 * bandwidth there on an AVX2 EPYC (blocking and packing set up for large M). This reads each
 * weight row once, contiguously, and keeps one accumulator vector per input row in registers,
 * so the loop is as fast as memory delivers the weight.
 *
 * Layouts (element strides; rows contiguous in the last dim):
 *   x  [m, k]     row stride x_s0
 *   w  [n, k]     row stride w_s0 (nn.Linear's weight)
 *   b  [n] or NULL
 *   y  [m, n]     row stride y_s0
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_math.h"

/* Must match SMALL_LINEAR_MAX_ROWS in kernels/cpu_small_linear.py (which checks m). */
#define MAX_ROWS 8
/* Weight prefetched 8 KiB ahead of the row being read (2-32 KiB measured; 8 best). */
#define PREFETCH_FLOATS 2048

/* Output columns [j0, j1) for exactly M rows (a constant after inlining, so acc[] lives in
 * registers). Two accumulator sets over alternate k chunks break the FMA latency chain that
 * one set per row would leave at small M. */
static inline __attribute__((always_inline)) void rows_block(
        const float *x, int64_t x_s0, const float *w, int64_t w_s0, const float *b, float *y,
        int64_t y_s0, const int M, int64_t j0, int64_t j1, int64_t k) {
    const int64_t kv = k / (2 * VEC_WIDTH) * (2 * VEC_WIDTH);
    for (int64_t j = j0; j < j1; j++) {
        const float *wr = w + j * w_s0;
        vfloat a0[MAX_ROWS], a1[MAX_ROWS];
        for (int m = 0; m < M; m++) a0[m] = a1[m] = vsplat(0.0f);
        for (int64_t c = 0; c < kv; c += 2 * VEC_WIDTH) {
            vfloat w0, w1;
            __builtin_prefetch(wr + PREFETCH_FLOATS + c);
            memcpy(&w0, wr + c, sizeof w0);
            memcpy(&w1, wr + c + VEC_WIDTH, sizeof w1);
            for (int m = 0; m < M; m++) {
                vfloat x0, x1;
                memcpy(&x0, x + m * x_s0 + c, sizeof x0);
                memcpy(&x1, x + m * x_s0 + c + VEC_WIDTH, sizeof x1);
                a0[m] += w0 * x0;
                a1[m] += w1 * x1;
            }
        }
        for (int m = 0; m < M; m++) {
            float s = vsum_lanes(a0[m] + a1[m]);
            for (int64_t c = kv; c < k; c++) s += wr[c] * x[m * x_s0 + c];
            y[m * y_s0 + j] = b ? s + b[j] : s;
        }
    }
}

void small_linear_f32(const float *x, int64_t x_s0, const float *w, int64_t w_s0,
                      const float *b, float *y, int64_t y_s0, int m, int64_t n, int64_t k,
                      int num_threads) {
    /* Static chunks of whole columns: each thread streams its own slice of the weight. */
#pragma omp parallel num_threads(num_threads) if (n * k >= 65536)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        const int64_t j0 = n * t / nt, j1 = n * (t + 1) / nt;
        switch (m) {
#define CASE(M) case M: rows_block(x, x_s0, w, w_s0, b, y, y_s0, M, j0, j1, k); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default: break;
        }
    }
}
