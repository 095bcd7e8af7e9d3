/* Quantized projections with 8-bit activations: y[M, N] = x[M, K] @ W.T, W int4 or int8, for
 * decode steps of several rows (gemv.c's int16 rows are exact but cost ~5 integer ops per 32
 * weights per row: at 32 rows its tiles lose to oneDNN's bf16 GEMM).
 *
 * Each row of x is quantized to int8 per group of 32 (scale = max|x| / 127, as llama.cpp's Q8
 * rows) and multiplied with the unsigned 4-bit (or offset 8-bit) weights four at a time into
 * int32 lanes: one VNNI ``vpdpbusd`` per 64 multiply-adds on AVX-512, ``vpmaddubsw`` + ``vpmaddwd``
 * per 32 on AVX2. The weights are stored in blocks of LANES output features so that each int32 lane
 * is one feature: a group's sum needs no horizontal add, its scales are one vector of LANES features,
 * and a weight block unpacked once serves a tile of up to RT rows from registers.
 *
 * Layout (generator/kernels/formats.py, block_q4 / block_q8), per block of LANES features and group g:
 * int4: 4 chunks of LANES * 4 bytes; in chunk c, byte 4l + t holds q[l, 4c + t] (low nibble) and
 *       q[l, 16 + 4c + t] (high nibble); w = q * d + m.
 * int8: 8 chunks; in chunk c, byte 4l + t holds q[l, 4c + t] + 128 (unsigned), w = byte * d + m with
 *       d = s[l] and m = -128 * s[l].
 * d, m: [blocks, G, LANES] fp32. Features past N (the last block's padding) are zero and not written.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

#define GROUP 32
#define RT 8 /* rows of x that share one unpacked weight block */

/* The blocks are VF_LANES features wide (simd.h): 16 where VNNI multiplies four byte pairs an instruction,
 * else AVX2's 8 (an AVX-512 CPU without VNNI too: its byte products would be AVX2's, only wider). */
#if !defined(__AVX512VNNI__)
#define SIMD_BITS 256
#endif
#include "simd.h"
#define LANES VF_LANES

int tp_gemm8_lanes(void) { return LANES; }

/* x[M, K] -> x8 (int8 per group of 32, |q| <= xmax), sx (each group's scale), xs (its sum as quantized) */
static int quantize8(const void *x, int bf16, long M, long Mp, long K, int xmax, int8_t **x8, float **sx,
                     float **xs) {
    const long G = K / GROUP; /* rows M..Mp-1 (AMX tiles' padding) are zeros */
    *x8 = calloc(Mp * K + 64, 1);
    *sx = calloc(Mp * G * 2, sizeof(float));
    if (!*x8 || !*sx) { free(*x8); free(*sx); return -1; }
    *xs = *sx + Mp * G;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long i = 0; i < M * G; i++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = load8(x, i * GROUP + 8 * j, bf16);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        const float am = hmax(amax);
        const __m256 inv = _mm256_set1_ps(am > 0.f ? (float)xmax / am : 0.f);
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)); /* nearest even */
        const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        /* the two packs interleave 4-byte runs of the four vectors per 128-bit lane; the permute restores x's order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(*x8 + i * GROUP), _mm256_permutevar8x32_epi32(p, order));
        (*sx)[i] = am / (float)xmax;
        /* the offset term sums x as quantized, so the group's result is W . x8 * scale: with the exact sum it
         * would keep the error of sum(q * x8) over unsigned, uncentred q, 3x larger (tests/test_gemv.py) */
        (*xs)[i] = hsum(_mm256_cvtepi32_ps(qs)) * (*sx)[i];
    }
    return 0;
}

static inline vi bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vi_set1_32(v);
}

/* One block of LANES features against R rows: out[r][l] = y[r, block's feature l] */
static inline __attribute__((always_inline)) void block_tile(
    const uint8_t *wb, const float *db, const float *mb, int bits, const int8_t *x8, const float *sx,
    const float *xs, long G, long K, int R, float out[RT][LANES])
{
    vf acc[RT];
    const vi low = vi_set1_8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    for (long g = 0; g < G; g++) {
        vi w[8]; /* w[c]: weights 4c..4c+3 of the group, four bytes per feature */
        if (bits == 4) {
            const uint8_t *p = wb + g * LANES * 16;
            for (int c = 0; c < 4; c++) {
                const vi v = vi_load(p + c * LANES * 4);
                w[c] = vi_and(v, low);
                w[c + 4] = vi_and(vi_srl16(v, 4), low);
            }
        } else {
            const uint8_t *p = wb + g * LANES * 32;
            for (int c = 0; c < 8; c++) w[c] = vi_load(p + c * LANES * 4);
        }
        const vf d = vf_load(db + g * LANES), m = vf_load(mb + g * LANES);
        for (int r = 0; r < R; r++) {
            const int8_t *xg = x8 + r * K + g * GROUP;
            vi a = vi_zero(), b = vi_zero(); /* two chains: the sum's latency is not the step's */
            for (int c = 0; c < 4; c++) {
                a = vi_dpbusd(a, w[c], bcast4(xg + 4 * c));
                b = vi_dpbusd(b, w[c + 4], bcast4(xg + 16 + 4 * c));
            }
            acc[r] = vf_fma(vf_from_i32(vi_add32(a, b)), vf_mul(d, vf_set1(sx[r * G + g])), acc[r]);
            acc[r] = vf_fma(m, vf_set1(xs[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) vf_store(out[r], acc[r]);
}

/* block_tile with the row count as a constant (bits is one where called), so each tile keeps its
 * accumulators in registers */
static inline __attribute__((always_inline)) void block_rows(
    const uint8_t *wb, const float *db, const float *mb, const int bits, const int8_t *x8, const float *sx,
    const float *xs, long G, long K, int R, float out[RT][LANES])
{
    switch (R) {
    case 1: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, 1, out); break;
    case 2: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, 2, out); break;
    case 3: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, 3, out); break;
    case 4: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, 4, out); break;
    case 5: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, 5, out); break;
    case 6: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, 6, out); break;
    case 7: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, 7, out); break;
    default: block_tile(wb, db, mb, bits, x8, sx, xs, G, K, RT, out); break;
    }
}

#if defined(__AMX_INT8__) && LANES == 16
/* The same product on AMX tiles (built where the CPU lists amx_int8, generator/kernels/build.py), for more
 * rows: one TDPBSUD multiplies 16 rows of int8 x by a block's group of 32 unsigned weights (16
 * features) into 16 x 16 int32 sums, where the VNNI loop above spends 8 instructions per row. The
 * group's scales then apply per row as above, 16 accumulators in registers; the block's weights for
 * the next 16 rows are unpacked again (a few ops per group). Rows go in tiles of 16, x padded with
 * zero rows. A thread must configure its tiles before use, and Linux grants a process the tiles'
 * state only when asked (arch_prctl), once. */
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int tp_gemm8_tiles(void) {
    static int state; /* 0 unasked, 1 granted, -1 refused */
    if (!__atomic_load_n(&state, __ATOMIC_ACQUIRE))
        __atomic_store_n(&state, syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 1,
                         __ATOMIC_RELEASE);
    return __atomic_load_n(&state, __ATOMIC_ACQUIRE) == 1;
}

/* tile 0: 16 rows of x (32 int8 of one group), 1: the group's weights (8 rows of 4 k x 16 features), 2: sums */
static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = GROUP;
    cfg.rows[1] = GROUP / 4, cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = 64;
    _tile_loadconfig(&cfg);
}

/* One block of 16 features against rows r0..r0+15 of x8: out[r][l] (r < 16) */
static inline void block_tiles(const uint8_t *wb, const float *db, const float *mb, int bits, const int8_t *x8,
                               const float *sx, const float *xs, long G, long K, float out[16][16]) {
    __m512 acc[16];
    int32_t sums[16][16] __attribute__((aligned(64)));
    uint8_t wt[GROUP / 4][64] __attribute__((aligned(64)));
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        if (bits == 4) { /* chunk c's low nibbles are k = 4c.., its high ones k = 16 + 4c..: tile rows c, 4 + c */
            const uint8_t *p = wb + g * 16 * 16;
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(p + c * 64);
                _mm512_store_si512(wt[c], _mm512_and_si512(v, low));
                _mm512_store_si512(wt[4 + c], _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
            _tile_loadd(1, wt, 64);
        } else { /* the 8 chunks are the tile's rows as stored */
            _tile_loadd(1, wb + g * 16 * 32, 64);
        }
        _tile_loadd(0, x8 + g * GROUP, K);
        _tile_zero(2);
        _tile_dpbsud(2, 0, 1);
        _tile_stored(2, sums, 64);
        const __m512 d = _mm512_loadu_ps(db + g * 16), m = _mm512_loadu_ps(mb + g * 16);
        for (int r = 0; r < 16; r++) {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums[r]));
            acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(sx[r * G + g])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < 16; r++) _mm512_storeu_ps(out[r], acc[r]);
}

static int gemm8_tiles(const uint8_t *w, const float *d, const float *m, int bits, const void *x, void *y, long M,
                       long K, long N, int threads, int bf16) {
    const long Mp = (M + 15) / 16 * 16;
    int8_t *x8;
    float *sx, *xs;
    if (quantize8(x, bf16, M, Mp, K, 127, &x8, &sx, &xs)) return -1;
    const long G = K / GROUP, blocks = (N + 15) / 16, gbytes = 16 * (bits == 4 ? 16 : 32);
    #pragma omp parallel num_threads(threads)
    {
        configure_tiles();
        #pragma omp for schedule(static)
        for (long blk = 0; blk < blocks; blk++) {
            const long n0 = blk * 16, width = N - n0 < 16 ? N - n0 : 16;
            for (long r0 = 0; r0 < M; r0 += 16) {
                float out[16][16];
                block_tiles(w + blk * G * gbytes, d + blk * G * 16, m + blk * G * 16, bits, x8 + r0 * K,
                            sx + r0 * G, xs + r0 * G, G, K, out);
                const long R = M - r0 < 16 ? M - r0 : 16;
                for (long r = 0; r < R; r++)
                    for (long l = 0; l < width; l++) put(y, (r0 + r) * N + n0 + l, out[r][l], bf16);
            }
        }
        _tile_release();
    }
    free(x8);
    free(sx);
    return 0;
}
#else
int tp_gemm8_tiles(void) { return 0; }
#endif

/* Returns 0, or -1 when out of memory. K must be a multiple of 32; ``bits`` 4 or 8; x and y are bf16
 * with ``bf16``, else fp32. ``tiles``: on AMX where built and granted (tp_gemm8_tiles), else the loop above. */
int tp_gemm8(const uint8_t *w, const float *d, const float *m, int bits, const void *x, void *y, long M, long K,
             long N, int threads, int bf16, int tiles)
{
#if defined(__AMX_INT8__) && LANES == 16
    if (tiles && tp_gemm8_tiles()) return gemm8_tiles(w, d, m, bits, x, y, M, K, N, threads, bf16);
#else
    (void)tiles;
#endif
    /* AVX2's int16 pair sums saturate past 32767: 255 * 64 * 2 stays below, 255 * 127 * 2 would not */
    const int xmax = bits == 8 && LANES == 8 ? 64 : 127;
    int8_t *x8;
    float *sx, *xs;
    if (quantize8(x, bf16, M, M, K, xmax, &x8, &sx, &xs)) return -1;
    const long G = K / GROUP, blocks = (N + LANES - 1) / LANES, gbytes = LANES * (bits == 4 ? 16 : 32);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long blk = 0; blk < blocks; blk++) {
        const uint8_t *wb = w + blk * G * gbytes;
        const float *db = d + blk * G * LANES, *mb = m + blk * G * LANES;
        const long n0 = blk * LANES, width = N - n0 < LANES ? N - n0 : LANES;
        for (long r0 = 0; r0 < M; r0 += RT) {
            const int R = M - r0 < RT ? (int)(M - r0) : RT;
            const int8_t *x0 = x8 + r0 * K;
            const float *sx0 = sx + r0 * G, *xs0 = xs + r0 * G;
            float out[RT][LANES];
            if (bits == 4) block_rows(wb, db, mb, 4, x0, sx0, xs0, G, K, R, out);
            else block_rows(wb, db, mb, 8, x0, sx0, xs0, G, K, R, out);
            for (int r = 0; r < R; r++)
                for (long l = 0; l < width; l++) put(y, (r0 + r) * N + n0 + l, out[r][l], bf16);
        }
    }
    free(x8);
    free(sx);
    return 0;
}
