/* A decode step's decoder layers in one call: the CPU's stand-in for a captured CUDA graph.
 *
 * The Python model launches ~10 kernels per layer. At decode batch sizes each launch's Python
 * side (module calls, views, output allocation, the launchers' checks, ctypes) cost about as
 * much as the small kernels themselves: 3-4 ms of a 30 ms tiny-llama step at batch 40 on the
 * 2-core VM, serial, with the second core idle. Here the same kernels run in the same order on
 * the same threads, so the hidden states come out bit for bit as the Python path leaves them
 * (tests/test_cpu_graph.py); Python validates once per step (engine/cpu_graph.py).
 *
 * Whole decode-only steps (decode_graph_f32); steps with prefill rows run each layer's parts
 * before and after the attention here and the attention in Python (the layer_*_attention_f32
 * pair). float32, one rank (no all-reduce between the GEMMs), every linear layer
 * on oneMKL's packed GEMM (through the function pointer the caller resolved from torch's own
 * oneMKL) or, at up to MAX_ROWS rows where the layer kept its plain weight, the few-rows
 * kernel. Layouts as in the kernels included below; activations are contiguous rows.
 */
#include <stdint.h>
#include <string.h>

#include "fused_ops_cpu.c"
#include "kv_write_cpu.c"
#include "paged_decode_cpu.c"
#include "small_linear_cpu.c"

/* oneMKL's cblas_sgemm_compute (LP64 integers), CBLAS enumerations from mkl_cblas.h. */
typedef void (*sgemm_compute_fn)(int layout, int transa, int transb, int m, int n, int k,
                                 const float *a, int lda, const void *b, int ldb, float beta,
                                 float *c, int ldc);
#define CBLAS_ROW_MAJOR 101
#define CBLAS_NO_TRANS 111
#define CBLAS_PACKED 151

struct linear_w {
    const void *packed;  /* the oneMKL pack of W [n, k] */
    const float *plain;  /* W itself, for the few-rows kernel; NULL when not kept */
    const float *bias;   /* [n] or NULL */
    int64_t n, k;
};

struct layer_w {
    struct linear_w qkv, o, gate_up, down;
    const float *input_norm, *post_norm;  /* [hidden] */
    const float *q_norm, *k_norm;         /* [head_size] (Qwen3), or NULL */
    float *k_cache, *v_cache;             /* this layer's [num_blocks, block_size, kv, D] */
};

struct model_w {
    int num_layers, hidden, num_heads, num_kv_heads, head_size, inter;
    float eps, scale;
    int64_t cache_bs;  /* a layer view's block stride, elements */
    int block_size;
    const float *cos_sin;  /* [max_position, head_size] */
    const float *final_norm;
    sgemm_compute_fn gemm;
    const struct layer_w *layers;
};

struct step_in {
    int num_tokens;  /* one per sequence */
    const int64_t *positions, *slots;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens;
};

/* Contiguous row buffers of at least num_tokens rows each. */
struct scratch {
    float *residual, *h;  /* [T, hidden] */
    float *qkv;               /* [T, (heads + 2 kv) * D] */
    float *qn, *kn;           /* [T, heads * D], [T, kv * D]: q/k-norm outputs */
    float *attn;              /* [T, heads * D] */
    float *gate_up, *act;     /* [T, 2 inter], [T, inter] */
};

/* y [m, n] = x [m, k] W^T (+ b), the way engine/layers/linear.py's linear_forward picks. */
static void linear(sgemm_compute_fn gemm, const struct linear_w *w, const float *x, float *y,
                   int m, int threads) {
    if (w->plain != NULL && m <= MAX_ROWS) {
        small_linear_f32(x, w->k, w->plain, w->k, w->bias, y, w->n, m, w->n, w->k, threads);
        return;
    }
    if (w->bias != NULL)  /* the GEMM adds onto it (beta 1) */
        for (int i = 0; i < m; i++) memcpy(y + (int64_t)i * w->n, w->bias, w->n * sizeof(float));
    gemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_PACKED, m, (int)w->n, (int)w->k, x, (int)w->k,
         w->packed, (int)w->k, w->bias != NULL ? 1.0f : 0.0f, y, (int)w->n);
}

/* Layer i up to its attention, over x [T, hidden] (the layer's input): the input norm (adding
 * into the residual stream, except at layer 0), qkv, the q/k norms, RoPE, and the K/V write.
 * q is left at s->qn when the layer has q/k norms, else in s->qkv (rows of the fused width);
 * k likewise at s->kn or in s->qkv; v in s->qkv. */
static void pre_attention(const struct model_w *m, int i, const struct step_in *in, float *x,
                          struct scratch *s, int threads) {
    const struct layer_w *l = &m->layers[i];
    const int T = in->num_tokens, D = m->head_size, H = m->hidden;
    const int64_t q_size = (int64_t)m->num_heads * D, kv_size = (int64_t)m->num_kv_heads * D;
    const int64_t width = q_size + 2 * kv_size;
    rms_norm_f32(x, H, 0, i == 0 ? NULL : s->residual, H, 0, l->input_norm, x, H, 0, T, 1, H,
                 m->eps, threads);
    linear(m->gemm, &l->qkv, x, s->qkv, T, threads);
    float *q = s->qkv, *k = s->qkv + q_size;
    const float *v = s->qkv + q_size + kv_size;
    int64_t q_s0 = width, k_s0 = width;
    if (l->q_norm != NULL) {  /* per head, into contiguous rows, as RMSNorm.forward does */
        rms_norm_f32(q, width, D, NULL, 0, 0, l->q_norm, s->qn, q_size, D, T, m->num_heads, D,
                     m->eps, threads);
        rms_norm_f32(k, width, D, NULL, 0, 0, l->k_norm, s->kn, kv_size, D, T,
                     m->num_kv_heads, D, m->eps, threads);
        q = s->qn, k = s->kn, q_s0 = q_size, k_s0 = kv_size;
    }
    rotary_neox_f32(in->positions, q, q_s0, D, m->num_heads, k, k_s0, D, m->num_kv_heads,
                    m->cos_sin, D, T, threads);
    write_kv_f32(k, k_s0, v, width, l->k_cache, l->v_cache, m->cache_bs, in->slots, T, kv_size,
                 m->block_size, threads);
}

/* Layer i after its attention (s->attn [T, heads * D]): o-proj, the post-attention norm, the
 * MLP into x; after the last layer, the final norm over x. */
void layer_post_attention_f32(const struct model_w *m, const struct step_in *in, float *x,
                              struct scratch *s, int i, int threads) {
    const struct layer_w *l = &m->layers[i];
    const int T = in->num_tokens, H = m->hidden;
    linear(m->gemm, &l->o, s->attn, s->h, T, threads);
    rms_norm_f32(s->h, H, 0, s->residual, H, 0, l->post_norm, s->h, H, 0, T, 1, H, m->eps,
                 threads);
    linear(m->gemm, &l->gate_up, s->h, s->gate_up, T, threads);
    silu_and_mul_f32(s->gate_up, 2 * (int64_t)m->inter, s->act, m->inter, T, m->inter, threads);
    linear(m->gemm, &l->down, s->act, x, T, threads);
    if (i == m->num_layers - 1)
        rms_norm_f32(x, H, 0, s->residual, H, 0, m->final_norm, x, H, 0, T, 1, H, m->eps,
                     threads);
}

/* hidden [T, hidden] is the step's embeddings before layer 0 (its copy starts the residual
 * stream), each layer's output between layers, and the final normed hidden states after the
 * last. Steps with prefill rows call this and layer_post_attention_f32 around the Python
 * attention backend. */
void layer_pre_attention_f32(const struct model_w *m, const struct step_in *in, float *hidden,
                             struct scratch *s, int layer, int threads) {
    if (layer == 0)
        memcpy(s->residual, hidden, (size_t)in->num_tokens * m->hidden * sizeof(float));
    pre_attention(m, layer, in, hidden, s, threads);
}

/* Decoder layers [begin, end) of a decode-only step, attention included (one query token per
 * sequence, in->block_tables and in->seq_lens). */
void decode_graph_f32(const struct model_w *m, const struct step_in *in, float *hidden,
                      struct scratch *s, int begin, int end, int threads) {
    const int D = m->head_size;
    const int64_t q_size = (int64_t)m->num_heads * D, kv_size = (int64_t)m->num_kv_heads * D;
    for (int i = begin; i < end; i++) {
        const struct layer_w *l = &m->layers[i];
        layer_pre_attention_f32(m, in, hidden, s, i, threads);
        const float *q = l->q_norm != NULL ? s->qn : s->qkv;
        const int64_t q_s0 = l->q_norm != NULL ? q_size : q_size + 2 * kv_size;
        paged_decode_attention_f32(q, q_s0, D, l->k_cache, l->v_cache, m->cache_bs,
                                   in->block_tables, in->table_stride, in->seq_lens, s->attn,
                                   q_size, D, in->num_tokens, m->num_heads, m->num_kv_heads, D,
                                   m->block_size, m->scale, threads);
        layer_post_attention_f32(m, in, hidden, s, i, threads);
    }
}
