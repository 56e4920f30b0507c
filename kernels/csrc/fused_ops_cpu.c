/* Element-wise layers for the CPU, float32, each one pass over its rows: RMSNorm (optionally
 * with the residual add before it), neox rotary embedding in place, and SiLU(gate) * up.
 *
 * Written in torch these are 2-10 small ops each, every one a separate pass over memory with
 * its own allocation and dispatch: 2-45x slower than one pass (one thread, 1-2048 tokens of
 * tiny-llama). Rows (tokens) are spread over OpenMP threads; the loops in a row vectorize.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

/* Rows below this many elements in total run on one thread: waking the other costs more. */
#define PARALLEL_MIN_ELEMS 16384

/* out[t, h] = weight * (r / sqrt(mean(r^2) + eps)) for every row r = x[t, h] (hidden
 * elements), or, when residual is given, r = x[t, h] + residual[t, h], stored back into
 * residual (the stream the next layer adds to). Rows are addressed by two strides, so a
 * per-head norm (Qwen3's q/k norm) reads the heads of a fused qkv row in place; 2-D callers
 * pass n1 = 1. out may be x itself. Statistics in float32, as Hugging Face computes them. */
void rms_norm_f32(const float *x, int64_t x_s0, int64_t x_s1, float *residual, int64_t res_s0,
                  int64_t res_s1, const float *weight, float *out, int64_t out_s0,
                  int64_t out_s1, int64_t n0, int64_t n1, int64_t hidden, float eps,
                  int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (n0 * n1 * hidden >= PARALLEL_MIN_ELEMS)
    for (int64_t row = 0; row < n0 * n1; row++) {
        const int64_t t = row / n1, h = row % n1;
        const float *src = x + t * x_s0 + h * x_s1;
        float *o = out + t * out_s0 + h * out_s1;
        float ss = 0.0f;
        if (residual != NULL) {
            float *r = residual + t * res_s0 + h * res_s1;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) {
                const float v = src[i] + r[i];
                r[i] = v;
                ss += v * v;
            }
            src = r;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) ss += src[i] * src[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (src[i] * inv);
    }
}

static inline void rotate_heads(float *x, int64_t head_stride, int num_heads, const float *cos,
                                const float *sin, int64_t half) {
    for (int h = 0; h < num_heads; h++) {
        float *a = x + h * head_stride;
        float *b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/* Neox-style rotary embedding (rotate halves) of q and k in place. cos_sin holds a row per
 * position: head_size / 2 cosines, then as many sines. Positions were range-checked. */
void rotary_neox_f32(const int64_t *positions, float *q, int64_t q_tok_stride,
                     int64_t q_head_stride, int num_q_heads, float *k, int64_t k_tok_stride,
                     int64_t k_head_stride, int num_k_heads, const float *cos_sin,
                     int64_t head_size, int64_t num_tokens, int num_threads) {
    const int64_t half = head_size / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_tokens * (num_q_heads + num_k_heads) * head_size >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cos = cos_sin + positions[t] * head_size;
        const float *sin = cos + half;
        rotate_heads(q + t * q_tok_stride, q_head_stride, num_q_heads, cos, sin, half);
        rotate_heads(k + t * k_tok_stride, k_head_stride, num_k_heads, cos, sin, half);
    }
}

/* silu(g) * u with sigmoid from exp(-|g|), so exp's argument is never positive. */
static inline float silu_mul(float g, float u) {
    const float e = exp_nonpos(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f : e) / (1.0f + e) * u;
}

static inline vfloat silu_mul_vec(vfloat g, vfloat u) {
    const vfloat e = exp_nonpos_vec((vfloat)((vint)g | (vint)vsplat(-0.0f)));  /* -|g| */
    return g * vselect(g < vsplat(0.0f), e, vsplat(1.0f)) / (1.0f + e) * u;
}

/* out[t, i] = silu(x[t, i]) * x[t, d + i]: the gate and up halves of a fused gate_up row.
 * torch reads the strided halves in two passes and writes silu(gate) in between; this reads
 * each row once. */
void silu_and_mul_f32(const float *x, int64_t x_s0, float *out, int64_t out_s0,
                      int64_t num_tokens, int64_t d, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_tokens * d >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *gate = x + t * x_s0;
        const float *up = gate + d;
        float *o = out + t * out_s0;
        int64_t i = 0;
        for (; i + VEC_WIDTH <= d; i += VEC_WIDTH) {
            vfloat g, u;
            memcpy(&g, gate + i, sizeof g);  /* rows need not be vector-aligned */
            memcpy(&u, up + i, sizeof u);
            const vfloat r = silu_mul_vec(g, u);
            memcpy(o + i, &r, sizeof r);
        }
        for (; i < d; i++) o[i] = silu_mul(gate[i], up[i]);
    }
}
