/*
 * AMX tile helpers the CPU kernels share (small_gemm.c's bf16 GEMM, the cpu_paged extend kernel).
 * Only for a build whose compiler targets AMX (-march=native on Sapphire Rapids or later):
 * include it under #if defined(__AMX_TILE__) && defined(__AMX_BF16__).
 */
#ifndef PLUGSERVE_CPU_AMX_H
#define PLUGSERVE_CPU_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per library; 1 if
 * granted. */
static inline int amx_permitted(void) {
    static int state = -1;
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s;
}

/* All eight tiles 16 rows of 64 bytes (16 fp32, or 32 bf16 = 16 pairs). The configuration is per
 * thread: every thread loads it before its first tile instruction. */
static inline void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

#endif
