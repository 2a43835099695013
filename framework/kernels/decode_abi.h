/* The C interfaces of plugserve's fused decode step (decode_layers.c).
 *
 * A decode step of a Llama-family model on CPU is a chain of small C kernels per layer (RMSNorm,
 * GEMMs of a few rows, rotary embedding, paged attention). Called one by one from Python they cost
 * ~2 ms of interpreter and ctypes work per step at batch 1 (a fifth of a bf16 step here), so
 * decode_layers.c runs every layer's chain in one call. It reaches the kernels through function
 * pointers, so each stays in its own library, built with its own floating-point flags, and the
 * fused step computes bit for bit what the separate calls compute.
 *
 * The attention is the configured backend's: a backend that can run its decode attention from C
 * hands the fused step a function of this type and an opaque context it prepared for the batch
 * (framework.attention.base.AttentionBackend.native_decode). */
#ifndef PLUGSERVE_DECODE_ABI_H
#define PLUGSERVE_DECODE_ABI_H

#include <stdint.h>

/* Store this step's K and V of layer `layer` (the index in the list the backend was given) and
 * write the attention of each of the batch's rows into out. q: [rows, heads * head_dim], k and v:
 * [rows, kv_heads * head_dim], out: [rows, heads * head_dim], all contiguous in the model's dtype.
 * Returns 0, or a non-zero status of the backend's. */
typedef int (*plugserve_decode_attention_fn)(const void *ctx, int64_t layer, const void *q, const void *k,
                                             const void *v, void *out);

#endif
