/* Math shared by the CPU kernels in this folder. */
#ifndef PDSERVE_CPU_MATH_H
#define PDSERVE_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their running max), written so the compiler vectorizes it:
 * libm's expf is a scalar call, and one per (token, head) costs more than reading the K/V.
 * x = k ln2 + r with |r| <= ln2 / 2; exp(r) by Cephes' degree-6 polynomial (relative error
 * about 1e-7); 2^k built in the exponent bits. Below -87 the result flushes to 0.
 *
 * EXP_R(x, k) = x - k ln2 (ln2 in two parts, so the reduction stays exact) and EXP_POLY(r)
 * = exp(r) hold for a float or a vector alike: the scalar and vector versions share them. */
#define EXP_R(x, k) ((x) - (k) * 0.693359375f + (k) * 2.12194440e-4f)
#define EXP_POLY(r) \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) \
        + 4.1665795894e-2f) * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) \
     + (r) + 1.0f)

static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float k = (float)(int)(x * 1.44269504088896341f - 0.5f);  /* round half down */
    const float r = EXP_R(x, k);
    const float p = EXP_POLY(r);
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x <= -87.0f ? 0.0f : p * scale;
}

/* The widest registers the target has: a vector wider than them is split by GCC, and some
 * operations (the float/int conversions) then fall back to one lane at a time, which made
 * this file's kernels 3x slower than torch on an AVX2-only CPU. */
#if defined(__AVX512F__)
#define VEC_WIDTH 16
#elif defined(__AVX__)
#define VEC_WIDTH 8
#else
#define VEC_WIDTH 4
#endif
typedef float vfloat __attribute__((vector_size(4 * VEC_WIDTH)));
typedef int32_t vint __attribute__((vector_size(4 * VEC_WIDTH)));

static inline vfloat vsplat(float x) { return x - (vfloat){0}; }

/* The sum of v's lanes. */
static inline float vsum_lanes(vfloat v) {
    float s = 0.0f;
    for (int i = 0; i < VEC_WIDTH; i++) s += v[i];
    return s;
}

/* Lanes of a where mask is set (all ones), else lanes of b. */
static inline vfloat vselect(vint mask, vfloat a, vfloat b) {
    return (vfloat)(((vint)a & mask) | ((vint)b & ~mask));
}

/* Lane i of the result: the sum of p[i]'s lanes, for VEC_WIDTH vectors p (overwritten).
 * Each round adds neighbouring lanes of two vectors into one, halving the count: VEC_WIDTH
 * horizontal sums for VEC_WIDTH - 1 adds and twice as many shuffles, where one sum at a time
 * is a log2(VEC_WIDTH)-deep chain each. With 8 lanes the pairs are taken within 128-bit
 * halves (one vshufps each) and the halves are combined last. */
#if VEC_WIDTH == 8
#define PAIR_LO 0, 2, 8, 10, 4, 6, 12, 14
#define PAIR_HI 1, 3, 9, 11, 5, 7, 13, 15
#elif VEC_WIDTH == 4
#define PAIR_LO 0, 2, 4, 6
#define PAIR_HI 1, 3, 5, 7
#else
#define PAIR_LO 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define PAIR_HI 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#endif
static inline __attribute__((always_inline)) vfloat vsum_transpose(vfloat *p) {
#if VEC_WIDTH == 8
    for (int i = 0; i < 4; i++)  /* [p0 lo, lo, p1 lo, lo, p0 hi, hi, p1 hi, hi] partials */
        p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], PAIR_LO)
               + __builtin_shufflevector(p[2 * i], p[2 * i + 1], PAIR_HI);
    for (int i = 0; i < 2; i++)  /* [4 vectors' low-half sums, the same 4's high-half sums] */
        p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], PAIR_LO)
               + __builtin_shufflevector(p[2 * i], p[2 * i + 1], PAIR_HI);
    return __builtin_shufflevector(p[0], p[1], 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(p[0], p[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
    /* Even and odd lanes across the whole width: lane order comes out right by itself. */
    for (int n = VEC_WIDTH; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++)
            p[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], PAIR_LO)
                   + __builtin_shufflevector(p[2 * i], p[2 * i + 1], PAIR_HI);
    return p[0];
#endif
}

/* exp_nonpos over VEC_WIDTH lanes, in GCC/clang vector extensions: plain loops around the
 * scalar version are not vectorized by GCC (its clamp and flush are control flow to it), and
 * intrinsics would tie the file to one instruction set. Lanes below -87 give exp(-87)
 * (~1.6e-38) instead of 0. */
static inline vfloat exp_nonpos_vec(vfloat x) {
    x = vselect(x < vsplat(-87.0f), vsplat(-87.0f), x);
    const vint ki = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vint);
    const vfloat k = __builtin_convertvector(ki, vfloat);
    const vfloat r = EXP_R(x, k);
    const vfloat p = EXP_POLY(r);
    return p * (vfloat)((ki + 127) << 23);
}

#endif
