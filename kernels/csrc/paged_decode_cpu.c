/* Paged decode attention for the CPU, float32: one query token per sequence, GQA.
 *
 * The torch path gathers every sequence's blocks into a padded copy before attending, which
 * moves the K/V through memory twice. This kernel reads each block in place, once: scores for
 * a whole block, an online-softmax update, then the V rows weighted into an accumulator. The
 * query heads that share a KV head are handled together, so each K/V row is loaded once per
 * group. Work items are (sequence, KV head) pairs spread over OpenMP threads (the process's
 * one OpenMP runtime, which torch loaded first).
 *
 * On the Zen 4 VM it was bound by instructions (as fast on 512 KiB of K/V as on 64 MiB), so
 * the softmax and the V accumulation are written in vector extensions: GCC left the exp loop
 * scalar, and reloaded the accumulator row for every token. On the Zen 2 VM (2026-11) its
 * compute and its DRAM reads were found serialized (218 ns per token on one thread, against
 * 98 from cache and 104 for a bare read of the same bytes): see touch_row and
 * scores_by_token for what brought that to ~150.
 *
 * Layouts (element strides, all rows contiguous in head_size):
 *   q, out        [num_seqs, num_heads, head_size]
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_size], each block contiguous,
 *                 blocks cache_bs elements apart (the engine's cache is block-major, so a
 *                 layer's blocks sit 2 * num_layers blocks' worth apart)
 *   block_tables  [num_seqs, table_stride] int32
 *   seq_lens      [num_seqs] int32
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

/* Head sizes up to this take the vector P.V path (the accumulator row kept in registers). */
#define MAX_VEC_HEAD 128


/* Loads one float from each cache line of n floats at p and drops it.
 *
 * The V pass walks a block a head (a column) at a time, which the hardware prefetcher does
 * not follow, so the score loops load each V row this way, in row order next to its K row:
 * the DRAM reads then overlap the scores' compute (1.25x for sequences in DRAM, nothing lost
 * on ones in cache). Prefetches alone measured no better than none: a load the core must
 * complete. Items of one KV head (few sequences, whose K/V stays in cache) skip it: they read
 * a column anyway, and there it cost 5-10%. */
static inline void touch_row(const float *p, int n) {
    for (int c = 0; c < n; c += 64 / (int)sizeof(float)) {
        const float x = p[c];
#if defined(__x86_64__) || defined(__i386__)
        __asm__ volatile("" : : "x"(x));
#elif defined(__aarch64__)
        __asm__ volatile("" : : "w"(x));
#else
        __builtin_prefetch(p + c);
        (void)x;
#endif
    }
}

/* s[t, h] = q[h] . k[t, h / group] over one block, token by token: a token's dots are summed
 * lane-wise and VEC_WIDTH heads' partial vectors folded into one vector of scores together.
 * A horizontal sum per dot (the per-head path) took a third of the kernel's time. Also loads
 * the block's V rows in row order (see touch_row) and prefetches the next block's K rows.
 * Needs nh % VEC_WIDTH == 0 and head_size % VEC_WIDTH == 0. */
static inline __attribute__((always_inline)) void scores_by_token(
        const float *qs, const float *kb, const float *vb, const float *next_k, int64_t row,
        int ntok, int nkv, int group, int head_size, int touch_v, float *s) {
    const int nh = nkv * group, nv = head_size / VEC_WIDTH;
    int koff[nh];  /* head h's K offset in a row: no division per dot */
    for (int h = 0; h < nh; h++) koff[h] = h / group * head_size;
    /* The V loads and K prefetches (of this item's heads) are spread over the heads' dots, a
     * share each: issued in one burst per token they were slower from DRAM. */
    const int line = 64 / (int)sizeof(float), width = nkv * head_size;
    const int share = (width + nh * line - 1) / (nh * line) * line;
    for (int t = 0; t < ntok; t++) {
        for (int h0 = 0; h0 < nh; h0 += VEC_WIDTH) {
            vfloat part[VEC_WIDTH];
            for (int hh = 0; hh < VEC_WIDTH; hh++) {
                const int h = h0 + hh;
                const int c0 = h * share, c1 = c0 + share < width ? c0 + share : width;
                for (int c = c0; c < c1; c += line) {
                    if (touch_v) touch_row(vb + t * row + c, 1);
                    if (next_k) __builtin_prefetch(next_k + t * row + c);
                }
                const float *k = kb + t * row + koff[h];
                const float *qh = qs + h * head_size;
                /* Two chains, so consecutive FMAs do not wait on each other. */
                vfloat a = vsplat(0.0f), b = vsplat(0.0f);
                for (int i = 0; i < nv; i += 2) {
                    vfloat qv, kv;
                    memcpy(&qv, qh + i * VEC_WIDTH, sizeof qv);
                    memcpy(&kv, k + i * VEC_WIDTH, sizeof kv);
                    a += qv * kv;
                    if (i + 1 < nv) {
                        memcpy(&qv, qh + (i + 1) * VEC_WIDTH, sizeof qv);
                        memcpy(&kv, k + (i + 1) * VEC_WIDTH, sizeof kv);
                        b += qv * kv;
                    }
                }
                part[hh] = a + b;
            }
            const vfloat sc = vsum_transpose(part);
            memcpy(s + t * nh + h0, &sc, sizeof sc);
        }
    }
}

/* The online-softmax step for one block of s [ntok, nh] scores, VEC_WIDTH heads per vector:
 * the running max m and sum l move to the block's, the accumulator rows are rescaled, and s
 * becomes exp(s - m). */
static inline __attribute__((always_inline)) void softmax_by_token(
        float *s, int ntok, int nh, float *m, float *l, float *acc, int head_size) {
    for (int h0 = 0; h0 < nh; h0 += VEC_WIDTH) {
        vfloat mo, lo;
        memcpy(&mo, m + h0, sizeof mo);
        memcpy(&lo, l + h0, sizeof lo);
        vfloat mn = mo;
        for (int t = 0; t < ntok; t++) {
            vfloat x;
            memcpy(&x, s + t * nh + h0, sizeof x);
            mn = vselect(x > mn, x, mn);
        }
        /* A first block's old max is -inf: alpha is then ~1e-38 (exp_nonpos_vec's floor)
         * times an accumulator and sum that are still 0. */
        const vfloat alpha = exp_nonpos_vec(mo - mn);
        vfloat sum = vsplat(0.0f);
        for (int t = 0; t < ntok; t++) {
            vfloat x;
            memcpy(&x, s + t * nh + h0, sizeof x);
            x = exp_nonpos_vec(x - mn);
            memcpy(s + t * nh + h0, &x, sizeof x);
            sum += x;
        }
        lo = lo * alpha + sum;
        memcpy(m + h0, &mn, sizeof mn);
        memcpy(l + h0, &lo, sizeof lo);
        for (int hh = 0; hh < VEC_WIDTH; hh++) {
            float *ah = acc + (h0 + hh) * head_size;
            const float a = alpha[hh];
            for (int d = 0; d < head_size; d++) ah[d] *= a;
        }
    }
}

/* s[h, t] = q[h] . k[t, h / group] over one block, one dot at a time (heads that do not fill
 * whole vectors). Loads the block's V rows and prefetches the next block's K as
 * scores_by_token does. */
static inline __attribute__((always_inline)) void scores_by_head(
        const float *qs, const float *kb, const float *vb, const float *next_k, int64_t row,
        int ntok, int nkv, int group, int head_size, int block_size, int touch_v, float *s) {
    for (int t = 0; t < ntok; t++) {
        if (touch_v) touch_row(vb + t * row, (int)row);
        for (int g = 0; g < nkv; g++) {
            const float *k = kb + t * row + g * head_size;
            if (next_k)
                for (int c = 0; c < head_size; c += 64 / (int)sizeof(float))
                    __builtin_prefetch(next_k + t * row + g * head_size + c);
            /* Each K row once for the query heads that share it. */
            for (int j = 0; j < group; j++) {
                const int h = g * group + j;
                const float *qh = qs + h * head_size;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_size; d++) dot += qh[d] * k[d];
                s[h * block_size + t] = dot;
            }
        }
    }
}

/* softmax_by_token's step for s [nh, block_size] scores, one head at a time. */
static inline __attribute__((always_inline)) void softmax_by_head(
        float *s, int ntok, int nh, int block_size, float *m, float *l, float *acc,
        int head_size) {
    for (int h = 0; h < nh; h++) {
        float *sh = s + h * block_size;
        float bmax = m[h];
        int t = 0;
        if (ntok >= VEC_WIDTH) {
            vfloat vmax = vsplat(bmax);
            for (; t + VEC_WIDTH <= ntok; t += VEC_WIDTH) {
                vfloat x;
                memcpy(&x, sh + t, sizeof x);
                vmax = vselect(x > vmax, x, vmax);
            }
            for (int i = 0; i < VEC_WIDTH; i++) bmax = vmax[i] > bmax ? vmax[i] : bmax;
        }
        for (; t < ntok; t++) bmax = sh[t] > bmax ? sh[t] : bmax;
        const float alpha = m[h] == -INFINITY ? 0.0f : exp_nonpos(m[h] - bmax);
        /* A whole block's exps in vector registers: the scalar loop (which GCC left
         * unvectorized) was a third of the kernel's time. */
        vfloat vsum = vsplat(0.0f);
        for (t = 0; t + VEC_WIDTH <= ntok; t += VEC_WIDTH) {
            vfloat x;
            memcpy(&x, sh + t, sizeof x);
            x = exp_nonpos_vec(x - bmax);
            memcpy(sh + t, &x, sizeof x);
            vsum += x;
        }
        float sum = vsum_lanes(vsum);
        for (; t < ntok; t++) {
            sh[t] = exp_nonpos(sh[t] - bmax);
            sum += sh[t];
        }
        l[h] = l[h] * alpha + sum;
        m[h] = bmax;
        float *ah = acc + h * head_size;
#pragma omp simd
        for (int d = 0; d < head_size; d++) ah[d] *= alpha;
    }
}

/* acc[h] += sum_t p(h, t) * v[t, h / group] over one block, where p(h, t) is s[t, h] or
 * s[h, t] (by_token or not). Head-major, so a head's accumulator row stays in registers over
 * the block. */
static inline __attribute__((always_inline)) void accumulate_v(
        const float *s, int by_token, const float *vb, int64_t row, int ntok, int nh,
        int group, int head_size, int block_size, float *acc) {
    for (int h = 0; h < nh; h++) {
        const float *vh = vb + (h / group) * head_size;
        const float *ph = by_token ? s + h : s + h * block_size;  /* p(h, t) = ph[t * pt] */
        const int pt = by_token ? nh : 1;
        float *ah = acc + h * head_size;
        if (head_size % VEC_WIDTH == 0 && head_size <= MAX_VEC_HEAD) {
            /* Explicit vectors: GCC reloads and stores a plain array row every token. */
            vfloat av[MAX_VEC_HEAD / VEC_WIDTH];
            for (int i = 0; i < head_size / VEC_WIDTH; i++)
                memcpy(&av[i], ah + i * VEC_WIDTH, sizeof av[i]);
            for (int t = 0; t < ntok; t++) {
                const float *v = vh + t * row;
                const vfloat p = vsplat(ph[t * pt]);
                for (int i = 0; i < head_size / VEC_WIDTH; i++) {
                    vfloat vv;
                    memcpy(&vv, v + i * VEC_WIDTH, sizeof vv);
                    av[i] += p * vv;
                }
            }
            for (int i = 0; i < head_size / VEC_WIDTH; i++)
                memcpy(ah + i * VEC_WIDTH, &av[i], sizeof av[i]);
            continue;
        }
        for (int t = 0; t < ntok; t++) {
            const float *v = vh + t * row;
            const float p = ph[t * pt];
#pragma omp simd
            for (int d = 0; d < head_size; d++) ah[d] += p * v[d];
        }
    }
}

/* Attends query heads [kvh0 * group, (kvh0 + nkv) * group) of one sequence: KV heads
 * [kvh0, kvh0 + nkv). With every KV head in one item a block is read as one contiguous run. */
static inline __attribute__((always_inline)) void attend(const float *q, int64_t q_sh, const float *k_cache, const float *v_cache,
                   int64_t block_stride, const int32_t *table, int seq_len, int kvh0, int nkv,
                   int group, int num_kv_heads, int head_size, int block_size, float scale,
                   float *out, int64_t o_sh) {
    const int64_t row = (int64_t)num_kv_heads * head_size;  /* one token in the cache */
    const int nh = nkv * group;  /* query heads in this item */
    float m[nh], l[nh];
    /* Scores, then probabilities: [block_size, nh] when the heads fill whole vectors (each
     * token's head scores summed together, see scores_by_token), else [nh, block_size]. */
    const int by_token = nh % VEC_WIDTH == 0 && head_size % VEC_WIDTH == 0
                         && head_size <= MAX_VEC_HEAD;
    float s[nh * block_size];
    float acc[nh * head_size];  /* [nh, head_size] */
    float qs[nh * head_size];  /* [nh, head_size] the query rows, pre-scaled, packed */
    for (int h = 0; h < nh; h++)
        for (int d = 0; d < head_size; d++)
            qs[h * head_size + d] = q[(int64_t)h * q_sh + d] * scale;
    for (int h = 0; h < nh; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        for (int d = 0; d < head_size; d++) acc[h * head_size + d] = 0.0f;
    }
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int b = 0; b < num_blocks; b++) {
        const int64_t base = (int64_t)table[b] * block_stride + (int64_t)kvh0 * head_size;
        const int ntok = seq_len - b * block_size < block_size ? seq_len - b * block_size
                                                               : block_size;
        /* Blocks sit anywhere in the cache, so the hardware prefetcher loses the stream at
         * every block edge: fetch the next block's K rows while this one is computed. */
        const int64_t next = b + 1 < num_blocks
            ? (int64_t)table[b + 1] * block_stride + (int64_t)kvh0 * head_size : -1;
        if (by_token) {
            scores_by_token(qs, k_cache + base, v_cache + base, next < 0 ? NULL : k_cache + next,
                            row, ntok, nkv, group, head_size, nkv == num_kv_heads, s);
            softmax_by_token(s, ntok, nh, m, l, acc, head_size);
        } else {
            scores_by_head(qs, k_cache + base, v_cache + base, next < 0 ? NULL : k_cache + next,
                           row, ntok, nkv, group, head_size, block_size,
                           nkv == num_kv_heads, s);
            softmax_by_head(s, ntok, nh, block_size, m, l, acc, head_size);
        }
        accumulate_v(s, by_token, v_cache + base, row, ntok, nh, group, head_size, block_size,
                     acc);
    }
    for (int h = 0; h < nh; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        float *oh = out + (int64_t)h * o_sh;
        for (int d = 0; d < head_size; d++) oh[d] = acc[h * head_size + d] * inv;
    }
}

void paged_decode_attention_f32(const float *q, int64_t q_ss, int64_t q_sh,
                                const float *k_cache, const float *v_cache, int64_t cache_bs,
                                const int32_t *block_tables, int64_t table_stride,
                                const int32_t *seq_lens, float *out, int64_t o_ss, int64_t o_sh,
                                int num_seqs, int num_heads, int num_kv_heads, int head_size,
                                int block_size, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    /* Whole sequences per item when there are enough to share out (or one thread: a block's
     * rows then stream as one run, 1.3x faster for a lone sequence from DRAM); else one KV
     * head each. */
    const int per_item = num_threads == 1 || num_seqs >= 2 * num_threads ? num_kv_heads : 1;
    const int items_per_seq = num_kv_heads / per_item;
    const int64_t items = (int64_t)num_seqs * items_per_seq;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < items; i++) {
        const int seq = (int)(i / items_per_seq);
        const int kvh0 = (int)(i % items_per_seq) * per_item;
        const int64_t h0 = (int64_t)kvh0 * group;
        const float *qs = q + seq * q_ss + h0 * q_sh;
        const int32_t *table = block_tables + seq * table_stride;
        float *os = out + seq * o_ss + h0 * o_sh;
        /* Common head sizes as constants, so the compiler unrolls the head_size loops. */
        switch (head_size) {
        case 64:
            attend(qs, q_sh, k_cache, v_cache, cache_bs, table, seq_lens[seq], kvh0, per_item, group,
                   num_kv_heads, 64, block_size, scale, os, o_sh);
            break;
        case 128:
            attend(qs, q_sh, k_cache, v_cache, cache_bs, table, seq_lens[seq], kvh0, per_item, group,
                   num_kv_heads, 128, block_size, scale, os, o_sh);
            break;
        default:
            attend(qs, q_sh, k_cache, v_cache, cache_bs, table, seq_lens[seq], kvh0, per_item, group,
                   num_kv_heads, head_size, block_size, scale, os, o_sh);
        }
    }
}
