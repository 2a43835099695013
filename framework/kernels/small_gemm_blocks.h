/* The vector blocks of small_gemm.c, instantiated once per weight type and vector width. The
 * includer defines:
 *   SUFFIX                    the functions' name suffix;
 *   VEC, VLEN                 the accumulator vector type and how many k it covers per step;
 *   XVEC, WVEC                the input's and the weights' vector types (VEC but for bf16 pairs);
 *   VZERO()                   a zero accumulator;
 *   LOAD_X(a, m, k)           the input of row m from column k, as the FMA's second operand;
 *   LOAD_W(a, p, i, k)        the weights of row i of the panel at element p, from column k, as
 *                             the FMA's first operand;
 *   PREFETCH_W(a, p, i, k)    a prefetch of the line LOAD_W(a, p, i, k) reads;
 *   W_ELEM_BYTES              bytes per weight;
 *   FMA(w, x, acc)            acc + w * x, lane-wise;
 *   HSUM(acc)                 the sum of the accumulator's fp32 lanes.
 * Not a header to include anywhere else. */
#define SG_CAT2(a, b) a##_##b
#define SG_CAT(a, b) SG_CAT2(a, b)

/* ROWS_W weight rows from row n0 (nw of them real; n0 % ROWS_W == 0, so within one panel) times up
 * to ROWS_X input rows from m0. Padding rows of the panel are zeros: computed, never stored. */
static void SG_CAT(block, SUFFIX)(const gemm_args *a, int64_t n0, int64_t nw, int64_t m0, int64_t mx) {
    const int64_t p = (n0 / PANEL_ROWS) * a->Kp * PANEL_ROWS, i0 = n0 % PANEL_ROWS;
    VEC acc[ROWS_W][ROWS_X];
    for (int i = 0; i < ROWS_W; i++)
        for (int j = 0; j < ROWS_X; j++) acc[i][j] = VZERO();
    /* Input rows past mx repeat the last real one: the loads stay in bounds, the results are dropped. */
    int64_t xm[ROWS_X];
    for (int j = 0; j < ROWS_X; j++) xm[j] = m0 + (j < mx ? j : mx - 1);
    /* The first block over a panel prefetches ahead; the panel's later blocks find it in cache. */
    const int prefetch = m0 == 0;
    const int64_t ahead = p + PREFETCH_BYTES / W_ELEM_BYTES;
    if (mx == 1) {  /* one input row in a block of several (M % ROWS_X == 1): no wasted FMAs */
        for (int64_t k = 0; k < a->Kp; k += VLEN) {
            const XVEC xv = LOAD_X(a, xm[0], k);
            if (prefetch)
                for (int i = 0; i < ROWS_W; i++) PREFETCH_W(a, ahead, i0 + i, k);
            for (int i = 0; i < ROWS_W; i++) acc[i][0] = FMA(LOAD_W(a, p, i0 + i, k), xv, acc[i][0]);
        }
    } else {
        for (int64_t k = 0; k < a->Kp; k += VLEN) {
            if (prefetch)
                for (int i = 0; i < ROWS_W; i++) PREFETCH_W(a, ahead, i0 + i, k);
            XVEC xv[ROWS_X];
            for (int j = 0; j < ROWS_X; j++) xv[j] = LOAD_X(a, xm[j], k);
            for (int i = 0; i < ROWS_W; i++) {
                const WVEC wv = LOAD_W(a, p, i0 + i, k);
                for (int j = 0; j < ROWS_X; j++) acc[i][j] = FMA(wv, xv[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < mx; j++) store(a, m0 + j, n0 + i, HSUM(acc[i][j]));
}

/* M == 1 (single-stream decode): the panel from row n0 (nw rows real) against the one input row,
 * reading the panel front to back. */
static void SG_CAT(block_row1, SUFFIX)(const gemm_args *a, int64_t n0, int64_t nw) {
    const int64_t p = (n0 / PANEL_ROWS) * a->Kp * PANEL_ROWS;
    VEC acc[PANEL_ROWS];
    for (int i = 0; i < PANEL_ROWS; i++) acc[i] = VZERO();
    for (int64_t k = 0; k < a->Kp; k += VLEN) {
        const XVEC xv = LOAD_X(a, 0, k);
        for (int i = 0; i < PANEL_ROWS; i++) PREFETCH_W(a, p + PREFETCH_BYTES / W_ELEM_BYTES, i, k);
        for (int i = 0; i < PANEL_ROWS; i++) acc[i] = FMA(LOAD_W(a, p, i, k), xv, acc[i]);
    }
    for (int i = 0; i < nw; i++) store(a, 0, n0 + i, HSUM(acc[i]));
}

#undef SG_CAT
#undef SG_CAT2
