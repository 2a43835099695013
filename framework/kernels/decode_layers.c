/* A decode step's decoder layers in one call (see decode_abi.h for why).
 *
 * Per layer, for a Llama-family pre-norm block, with x the residual stream ([rows, hidden]):
 *
 *     h    = rmsnorm(x, input_norm)            rmsnorm.c
 *     qkv  = h @ W_qkv^T (+ b)                 small_gemm.c
 *     q,k,v = rope(qkv's q and k), v copied    rotary.c
 *     a    = attention(q, k, v)                the backend's plugserve_decode_attention_fn
 *     x'   = x + a @ W_o^T (+ b)               small_gemm.c, the add in its epilogue
 *     h    = rmsnorm(x', post_norm)
 *     g    = silu(h @ W_gate^T) * (h @ W_up^T) small_gemm.c's SwiGLU
 *     x    = x' + g @ W_down^T (+ b)
 *
 * i.e. the calls plugins/models/llama.py makes through the kernels' Python wrappers, with the same
 * arguments, so the result is bitwise the same. The kernels are reached through pointers the
 * Python side takes from their own libraries (decode_layers.py). */
#include <stddef.h>
#include <stdint.h>

#include "decode_abi.h"

typedef int (*norm_fn)(const void *x, int64_t ldx, const void *w, void *out, int64_t n, int64_t d, float eps,
                       int64_t threads);
typedef int (*gemm_fn)(const void *x, int64_t ldx, const void *w, const void *bias, const void *add, int64_t ld_add,
                       void *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads);
typedef int (*swiglu_fn)(const void *x, int64_t ldx, const void *w, const void *bias, void *act, int64_t ld_act,
                         int64_t M, int64_t N, int64_t K, int threads, int bf16);
typedef int (*rotary_fn)(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                         int64_t v_stride, const void *cos, const void *sin, int64_t cs_stride, void *q_out,
                         void *k_out, void *v_out, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t rot, int64_t threads);

/* The kernels of one dtype. */
typedef struct {
    norm_fn norm;
    gemm_fn gemm;
    swiglu_fn swiglu;
    rotary_fn rotary;
} decode_kernels;

/* One layer's weights: norm weights, and the linear weights in small_gemm.c's panel layout. */
typedef struct {
    const void *input_norm, *post_norm;
    float input_eps, post_eps;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
} decode_layer_weights;

/* The model's shapes and this step's buffers (each contiguous rows of the model's dtype). */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, rot, threads, bf16;
    const void *x_in;          /* [rows, hidden]: the embeddings, read only */
    void *x, *x_mid;           /* [rows, hidden]: the residual stream after / inside a layer */
    void *normed;              /* [rows, hidden] */
    void *qkv;                 /* [rows, (heads + 2 kv_heads) head_dim] */
    void *q, *k, *v, *attn;    /* [rows, heads or kv_heads head_dim] */
    void *act;                 /* [rows, intermediate] */
    const void *cos, *sin;     /* [rows, rot] each, row stride cs_stride */
    int64_t cs_stride;
    plugserve_decode_attention_fn attention;
    const void *attention_ctx;
} decode_step;

/* Status: 0, or (layer + 1) << 8 | stage << 4 | (the failing kernel's status & 15), stage 1 norm,
 * 2 qkv, 3 rope, 4 attention, 5 o_proj, 6 post norm, 7 gate/up, 8 down: the caller names it. */
static int64_t failed(int64_t layer, int stage, int status) {
    return (layer + 1) << 8 | stage << 4 | (status & 15);
}

/* Run n_layers layers; the result is in s->x. */
int64_t decode_layers(const decode_kernels *kn, const decode_layer_weights *layers, int64_t n_layers,
                      const decode_step *s) {
    const int64_t M = s->rows, H = s->hidden, D = s->head_dim, t = s->threads;
    const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_size = q_size + 2 * kv_size;
    const size_t elem = s->bf16 ? 2 : 4;
    const char *qkv = (const char *)s->qkv;
    for (int64_t i = 0; i < n_layers; i++) {
        const decode_layer_weights *w = &layers[i];
        const void *x = i == 0 ? s->x_in : s->x;
        int rc = kn->norm(x, H, w->input_norm, s->normed, M, H, w->input_eps, t);
        if (rc) return failed(i, 1, rc);
        rc = kn->gemm(s->normed, H, w->qkv, w->qkv_bias, NULL, 0, s->qkv, qkv_size, M, qkv_size, H, (int)t);
        if (rc) return failed(i, 2, rc);
        rc = kn->rotary(qkv, qkv_size, qkv + q_size * elem, qkv_size, qkv + (q_size + kv_size) * elem, qkv_size,
                        s->cos, s->sin, s->cs_stride, s->q, s->k, s->v, M, s->heads, s->kv_heads, D, s->rot, t);
        if (rc) return failed(i, 3, rc);
        rc = s->attention(s->attention_ctx, i, s->q, s->k, s->v, s->attn);
        if (rc) return failed(i, 4, rc);
        rc = kn->gemm(s->attn, q_size, w->o, w->o_bias, x, H, s->x_mid, H, M, H, q_size, (int)t);
        if (rc) return failed(i, 5, rc);
        rc = kn->norm(s->x_mid, H, w->post_norm, s->normed, M, H, w->post_eps, t);
        if (rc) return failed(i, 6, rc);
        rc = kn->swiglu(s->normed, H, w->gate_up, w->gate_up_bias, s->act, s->intermediate, M,
                        2 * s->intermediate, H, (int)t, (int)s->bf16);
        if (rc) return failed(i, 7, rc);
        rc = kn->gemm(s->act, s->intermediate, w->down, w->down_bias, s->x_mid, H, s->x, H, M, H, s->intermediate,
                      (int)t);
        if (rc) return failed(i, 8, rc);
    }
    return 0;
}
