/*
 * Paged decode attention on CPU, reading each request's K/V in place through its page table.
 *
 * Why a kernel: the torch path gathers every request's K/V into a padded buffer before SDPA reads
 * it again, so a decode step moves the whole KV context three times (read, write, read). Decode on
 * CPU is memory-bound, so reading it once is most of the win.
 *
 * Layout (what plugserve's KVCache and request pool hold):
 *   q        [bs, num_heads, head_dim]            float32, contiguous
 *   k, v     [num_slots, kv_heads, head_dim]      float32 or bfloat16, contiguous (one layer)
 *   table    [rows, table_stride]                 int32 slot of each token of each request row
 *   rows     [bs] int64 request row per query;  lens [bs] int64 context length per query
 *   out      [bs, num_heads, head_dim]            float32
 * Query heads h*group .. h*group+group-1 share kv head h (GQA), so each K/V row is read once for
 * the whole group. Work items (a request, or one kv head of it) are split over threads by token count.
 *
 * A bfloat16 cache (kv_cache.dtype=bfloat16) halves the bytes a decode step reads; each element is
 * widened to float32 on load (a 16-bit shift, exact), and all arithmetic stays float32.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_float.h"

typedef struct {
    const float *q;
    const void *k, *v; /* float32 or bfloat16 elements: the run function knows which */
    float *out;
    const int32_t *table;
    const int64_t *rows, *lens;
    int64_t table_stride, num_heads, kv_heads, head_dim, max_len;
    float scale;
    int64_t heads_per_item, item_begin, item_end;
    int status;
} job_t;

/* Element i of a K/V row of either type. `bf16` is a compile-time constant wherever this is used
 * (run_items is force-inlined into one wrapper per type), so each loop below is compiled twice,
 * each time straight-line, and gcc vectorises both. */
static inline float kv_at(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline const void *kv_row(const void *base, int64_t element, int bf16) {
    return (const char *)base + element * (bf16 ? 2 : 4);
}

/* Plain loops: compiled with -O3 and reassociation allowed, gcc turns them into FMA vector code. */
static inline float dot(const float *a, const void *b, int64_t n, int bf16) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * kv_at(b, i, bf16);
    return s;
}

static inline void axpy(float *y, float a, const void *x, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * kv_at(x, i, bf16);
}

/* Ask for the next token's row ahead of use: rows sit wherever the page table puts them, so the
 * hardware prefetcher cannot guess the next one. */
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)row + i, 0, 1);
}

static inline __attribute__((always_inline)) void *run_items(job_t *j, int bf16) {
    const int64_t d = j->head_dim, group = j->num_heads / j->kv_heads, hpi = j->heads_per_item;
    const int64_t per_req = j->kv_heads / hpi;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(hpi * group * (j->max_len > 0 ? j->max_len : 1)));
    if (!scores) {
        j->status = 1;
        return NULL;
    }
    for (int64_t item = j->item_begin; item < j->item_end; ++item) {
        const int64_t b = item / per_req, h0 = (item % per_req) * hpi, len = j->lens[b];
        const int32_t *slots = j->table + j->rows[b] * j->table_stride;
        /* query heads h0*group .. (h0+hpi)*group-1 are contiguous in q and out */
        const float *qh = j->q + (b * j->num_heads + h0 * group) * d;
        float *oh = j->out + (b * j->num_heads + h0 * group) * d;
        const int64_t nq = hpi * group, row_bytes = hpi * d * (bf16 ? 2 : 4);
        memset(oh, 0, sizeof(float) * (size_t)(nq * d));
        if (len <= 0) continue;
        /* pass 1: scores; one token's K row (all its kv heads) is contiguous, so read it whole */
        for (int64_t t = 0; t < len; ++t) {
            const void *kr = kv_row(j->k, ((int64_t)slots[t] * j->kv_heads + h0) * d, bf16);
            if (t + 1 < len) prefetch_row(kv_row(j->k, ((int64_t)slots[t + 1] * j->kv_heads + h0) * d, bf16), row_bytes);
            for (int64_t qi = 0; qi < nq; ++qi)
                scores[qi * len + t] = dot(qh + qi * d, kv_row(kr, (qi / group) * d, bf16), d, bf16) * j->scale;
        }
        /* softmax per query head, max-subtracted like SDPA */
        for (int64_t qi = 0; qi < nq; ++qi) {
            float *s = scores + qi * len, m = s[0], sum = 0.0f;
            for (int64_t t = 1; t < len; ++t) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < len; ++t) {
                s[t] = exp_nonpositive(s[t] - m);
                sum += s[t];
            }
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        }
        /* pass 2: weighted sum of the values */
        for (int64_t t = 0; t < len; ++t) {
            const void *vr = kv_row(j->v, ((int64_t)slots[t] * j->kv_heads + h0) * d, bf16);
            if (t + 1 < len) prefetch_row(kv_row(j->v, ((int64_t)slots[t + 1] * j->kv_heads + h0) * d, bf16), row_bytes);
            for (int64_t qi = 0; qi < nq; ++qi)
                axpy(oh + qi * d, scores[qi * len + t], kv_row(vr, (qi / group) * d, bf16), d, bf16);
        }
    }
    free(scores);
    return NULL;
}

static void *run_items_f32(void *arg) { return run_items((job_t *)arg, 0); }
static void *run_items_bf16(void *arg) { return run_items((job_t *)arg, 1); }

#define MAX_THREADS 64

/* k and v hold bfloat16 elements when kv_bf16 is non-zero, float32 otherwise.
 * Returns 0 on success, non-zero when memory or a thread could not be had. */
int paged_decode_attention(const float *q, const void *k, const void *v, float *out, const int32_t *table,
                           int64_t table_stride, const int64_t *rows, const int64_t *lens, int64_t bs,
                           int64_t num_heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t num_threads,
                           int64_t kv_bf16) {
    void *(*run)(void *) = kv_bf16 ? run_items_bf16 : run_items_f32;
    if (bs <= 0) return 0;
    if (kv_heads <= 0 || num_heads % kv_heads != 0) return 2;
    int64_t max_len = 0, total = 0;
    for (int64_t b = 0; b < bs; ++b) {
        max_len = lens[b] > max_len ? lens[b] : max_len;
        total += lens[b] + 1;
    }
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    /* Whole requests per item when there are enough of them (each K/V row is read in one piece);
     * one kv head per item for small batches, so that every thread has work. */
    const int64_t hpi = bs >= 4 * num_threads ? kv_heads : 1, per_req = kv_heads / hpi;
    const int64_t items = bs * per_req;
    if (num_threads > items) num_threads = items;
    job_t jobs[MAX_THREADS];
    /* Balance by tokens: thread i takes items until its share of the total context is reached. */
    int64_t item = 0, acc = 0;
    for (int64_t i = 0; i < num_threads; ++i) {
        const int64_t goal = total * per_req * (i + 1) / num_threads;
        job_t *j = &jobs[i];
        *j = (job_t){q, k, v, out, table, rows, lens, table_stride, num_heads, kv_heads, head_dim, max_len,
                     scale, hpi, item, item, 0};
        while (item < items && (acc < goal || i == num_threads - 1)) {
            acc += lens[item / per_req] + 1;
            ++item;
        }
        j->item_end = item;
    }
    int status = 0;
    if (num_threads == 1) {
        run(&jobs[0]);
    } else {
#ifdef _OPENMP
        /* torch's OpenMP workers spin for a while after each parallel region; a thread of our own
         * then fights one of them for a core (measured: 2 pthreads at batch 64 were no faster than
         * one, 5.3 ms per layer, and 7x slower at batch 1). Inside torch's process this region runs
         * on the same libgomp (matched by soname), i.e. on those already-spinning workers. */
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
        for (int64_t i = 0; i < num_threads; ++i)
            if (jobs[i].item_begin < jobs[i].item_end) run(&jobs[i]);
#else
        pthread_t threads[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        for (int64_t i = 1; i < num_threads; ++i) {
            if (jobs[i].item_begin == jobs[i].item_end) continue;
            if (pthread_create(&threads[i], NULL, run, &jobs[i]) == 0) {
                started[i] = 1;
            } else {
                run(&jobs[i]); /* no thread to be had: do its share here */
            }
        }
        run(&jobs[0]);
        for (int64_t i = 1; i < num_threads; ++i)
            if (started[i]) pthread_join(threads[i], NULL);
#endif
    }
    for (int64_t i = 0; i < num_threads; ++i) status |= jobs[i].status;
    return status;
}

/* 1 when built with OpenMP (threads come from the process's OpenMP runtime), 0 for pthreads. */
int paged_decode_uses_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
