/* The AMX tile state, shared by every kernel on matrix tiles (qgemm_amx.h, qgemm_amxbf16.h,
 * attention_amx.h): the CPU's AMX features, the per-process grant of the tile state, and
 * loading a tile configuration.
 *
 * Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per
 * process; asking again is harmless, and oneDNN asks the same). Each thread that multiplies
 * on tiles loads its configuration first and releases the tiles after.
 */
#ifndef NR_AMX_TILES_H
#define NR_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NR_TTILE __attribute__((target("amx-tile")))

/* CPUID leaf 7 subleaf 0, EDX */
#define NR_AMX_BF16 (1u << 22)
#define NR_AMX_TILE (1u << 24)
#define NR_AMX_INT8 (1u << 25)

/* 1 when the CPU has every AMX feature in `want` (NR_AMX_* bits). */
static inline int nr_amx_has(unsigned want) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    (void)a; (void)b; (void)c;
    return (d & want) == want;
}

/* 1 when the kernel lets this process use the AMX tile state. */
static int nr_amx_grant(void) {
#ifdef SYS_arch_prctl
    /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} nr_tilecfg;

/* ldtilecfg of c (palette 1, unused tiles and reserved bytes zero). NOTE: GCC 12 drops the
 * stores into a local config as dead (ldtilecfg is not seen to read them) unless the compiler
 * is told c's memory is used. */
static inline NR_TTILE void nr_tile_loadconfig(const nr_tilecfg* c) {
    __asm__ volatile("" : : "r"(c) : "memory");
    _tile_loadconfig(c);
}

/* Every one of the 8 tiles 16 rows x 64 bytes (C 16 x 16 f32 / int32, A 16 x 32 bf16, B 16
 * pairs x 16 lanes). */
static NR_TTILE void nr_tile_config_16x64(void) {
    nr_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    nr_tile_loadconfig(&c);
}

/* For callers compiled without AMX-TILE (the intrinsic itself must be inlined). */
static NR_TTILE void nr_tile_release(void) { _tile_release(); }

#endif
