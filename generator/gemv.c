/* Quantized projections for few rows on AVX2: y[M, N] = x[M, K] @ W.T, W int4 or int8.
 *
 * Built at start-up by generator/gemv.py (cc -O3 -mavx2 -mfma -fopenmp, plus -mavx512f -mavx512bw
 * [-mavx512vnni] where the CPU lists them: the one-row int4 loop then runs on AVX-512). Each row of x is
 * quantized to int16 per group of 32 (scale = max|x| / 32767, so the error is ~1e-5 of the
 * group's largest value, far below a bf16 cast's), and each group's dot product is exact in
 * int32 (vpmaddwd); one float multiply-add per group scales it. Reading a 4-bit weight this way
 * costs a few integer ops per 16 weights instead of converting each weight to a float.
 *
 * int4 layout (per output feature n, per group g of 32 inputs): 16 bytes, byte j holding
 * q[j] in its low and q[j + 16] in its high nibble; w = q * d[n, g] + m[n, g].
 * int8 layout: q[n, k] int8, w = q * s[n].
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "rows.h"

#define GROUP 32
#define TILE 4 /* rows of x that share one pass over the weight */

/* x[M, K] -> x16 (int16 per group of 32), dx (each group's scale), xs (each group's float sum).
 * Vectorized: it runs once per projection call, and per element in C it was ~4 us of a one-row
 * call's ~11 us fixed cost (bench/RESULTS.md, "issue 21, part 5"). */
static int quantize_rows(const void *x, int bf16, long M, long K, int16_t **x16, float **dx, float **xs) {
    const long G = K / GROUP;
    *x16 = malloc(sizeof(int16_t) * M * K);
    *dx = malloc(sizeof(float) * M * G * 2);
    if (!*x16 || !*dx) { free(*x16); free(*dx); return -1; }
    *xs = *dx + M * G;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (long i = 0; i < M * G; i++) {
        __m256 v[4], s = _mm256_setzero_ps(), amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = load8(x, i * GROUP + 8 * j, bf16);
            s = _mm256_add_ps(s, v[j]);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        const float am = hmax(amax);
        const __m256 inv = _mm256_set1_ps(am > 0.f ? 32767.f / am : 0.f);
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)); /* nearest even, as lrintf */
        /* packs interleaves the two inputs' 128-bit lanes; the permute puts the 16 values back in order */
        _mm256_storeu_si256((__m256i *)(*x16 + i * GROUP), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(*x16 + i * GROUP + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
        (*dx)[i] = am / 32767.f;
        (*xs)[i] = hsum(s);
    }
    return 0;
}

/* int32 dot of 32 weights (as two vectors of 16 int16) with one group of x16 */
static inline __m256 group_dot(__m256i wa, __m256i wb, const int16_t *xg) {
    __m256i s = _mm256_add_epi32(_mm256_madd_epi16(wa, _mm256_loadu_si256((const __m256i *)xg)),
                                 _mm256_madd_epi16(wb, _mm256_loadu_si256((const __m256i *)(xg + 16))));
    return _mm256_cvtepi32_ps(s);
}

/* One group's 32 weights as two vectors of 16 int16, in x's order. int4: the low nibbles are
 * weights 0-15, the high ones 16-31 (the layout above); int8: as stored. */
static inline void q4_unpack(const uint8_t *p, __m256i *wa, __m256i *wb) {
    const __m128i low = _mm_set1_epi8(0x0F), v = _mm_loadu_si128((const __m128i *)p);
    *wa = _mm256_cvtepu8_epi16(_mm_and_si128(v, low));
    *wb = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low));
}

static inline void q8_unpack(const int8_t *p, __m256i *wa, __m256i *wb) {
    *wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    *wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
}

static inline __attribute__((always_inline)) void q4_tile(
    const uint8_t *wn, const float *dn, const float *mn, const int16_t *x16, const float *dx, const float *xs,
    void *y, int bf16, int R, long K, long N, long n)
{
    const long G = K / GROUP;
    __m256 acc[TILE];
    float macc[TILE];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.f; }
    for (long g = 0; g < G; g++) {
        __m256i wa, wb;
        q4_unpack(wn + g * 16, &wa, &wb);
        const float d = dn[g], m = mn[g];
        for (int r = 0; r < R; r++) {
            const __m256 dot = group_dot(wa, wb, x16 + r * K + g * GROUP);
            acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * dx[r * G + g]), acc[r]);
            macc[r] += m * xs[r * G + g];
        }
    }
    for (int r = 0; r < R; r++) put(y, r * N + n, hsum(acc[r]) + macc[r], bf16);
}

static inline __attribute__((always_inline)) void q8_tile(
    const int8_t *wn, float sn, const int16_t *x16, const float *dx, void *y, int bf16, int R, long K, long N, long n)
{
    const long G = K / GROUP;
    __m256 acc[TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (long g = 0; g < G; g++) {
        __m256i wa, wb;
        q8_unpack(wn + g * GROUP, &wa, &wb);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(group_dot(wa, wb, x16 + r * K + g * GROUP), _mm256_set1_ps(dx[r * G + g]), acc[r]);
    }
    for (int r = 0; r < R; r++) put(y, r * N + n, sn * hsum(acc[r]), bf16);
}

/* One row of x (a one-stream decode step). Not the tiles above with R = 1: there each group's
 * scale is a scalar multiply and broadcast and its offset a scalar multiply-add, each on one
 * accumulator's chain. Here a row's scales (d * dx) and its offset term (sum of m * xs) are
 * computed 8 groups at a time first, each group's scale is a broadcast load, two accumulators
 * alternate, and the weights a few rows ahead are prefetched: 16-29 % less time for a step's
 * projections called back to back (bench/RESULTS.md, "issue 21, part 5"). */
#define CHUNK 64 /* groups whose scales are prepared at once (K up to 2048 in one) */
#define AHEAD 2048 /* bytes of weights prefetched ahead: the next rows of this thread's share */

static inline __m256 q4_group(const uint8_t *p, const int16_t *xg) {
    __m256i wa, wb;
    q4_unpack(p, &wa, &wb);
    return group_dot(wa, wb, xg);
}

static inline __m256 q8_group(const int8_t *p, const int16_t *xg) {
    __m256i wa, wb;
    q8_unpack(p, &wa, &wb);
    return group_dot(wa, wb, xg);
}

/* sc[g] = dn[g] * dx[g] for g < G; returns the sum of mn[g] * xs[g] */
static inline float row_scales(const float *dn, const float *mn, const float *dx, const float *xs, float *sc, long G) {
    __m256 mv = _mm256_setzero_ps();
    long g = 0;
    for (; g + 8 <= G; g += 8) {
        _mm256_storeu_ps(sc + g, _mm256_mul_ps(_mm256_loadu_ps(dn + g), _mm256_loadu_ps(dx + g)));
        mv = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(xs + g), mv);
    }
    float macc = hsum(mv);
    for (; g < G; g++) { sc[g] = dn[g] * dx[g]; macc += mn[g] * xs[g]; }
    return macc;
}

static inline float q4_row(const uint8_t *wn, const float *dn, const float *mn, const int16_t *x16, const float *dx,
                           const float *xs, long G) {
    float sc[CHUNK], macc = 0.f;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    _mm_prefetch((const char *)(dn + AHEAD / 2), _MM_HINT_T0);
    _mm_prefetch((const char *)(mn + AHEAD / 2), _MM_HINT_T0);
    for (long g0 = 0; g0 < G; g0 += CHUNK) {
        const long len = G - g0 < CHUNK ? G - g0 : CHUNK;
        macc += row_scales(dn + g0, mn + g0, dx + g0, xs + g0, sc, len);
        long j = 0;
        for (; j + 2 <= len; j += 2) {
            const long g = g0 + j;
            _mm_prefetch((const char *)(wn + g * 16 + AHEAD), _MM_HINT_T0);
            acc0 = _mm256_fmadd_ps(q4_group(wn + g * 16, x16 + g * GROUP), _mm256_broadcast_ss(sc + j), acc0);
            acc1 = _mm256_fmadd_ps(q4_group(wn + g * 16 + 16, x16 + g * GROUP + GROUP), _mm256_broadcast_ss(sc + j + 1), acc1);
        }
        if (j < len)
            acc0 = _mm256_fmadd_ps(q4_group(wn + (g0 + j) * 16, x16 + (g0 + j) * GROUP), _mm256_broadcast_ss(sc + j), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + macc;
}

#if defined(__AVX512BW__)
/* The one-row int4 loop on AVX-512 (built where the CPU has it, generator/gemv.py): four groups
 * (64 bytes, 128 weights) a step and no byte shuffle. Read as 32 lanes of 16 bits, the bytes 2i,
 * 2i+1 of a group hold q[2i], q[2i+16] (low, high nibble of the first) and q[2i+1], q[2i+17]: a
 * mask and three shifts give the four nibbles of every lane, where the AVX2 loop spends two
 * cross-lane widenings per group. x is laid out to match, once per call (interleave_x). Each group
 * owns four of the sum's 16 int32 lanes, so one permute spreads four groups' scales over them. */
#define BLOCK 4 /* groups per step */

/* xp, per block of 4 groups, 4 vectors of 32: X0[8h + i] = x[32h + 2i], X1 = x[32h + 2i + 16],
 * X2 = x[32h + 2i + 1], X3 = x[32h + 2i + 17] (h the group in the block, i < 8) */
static void interleave_x(const int16_t *x16, int16_t *xp, long blocks) {
    for (long b = 0; b < blocks; b++) {
        const int16_t *xb = x16 + b * BLOCK * GROUP;
        int16_t *o = xp + b * BLOCK * GROUP;
        for (int h = 0; h < BLOCK; h++)
            for (int i = 0; i < 8; i++) {
                o[0 * 32 + 8 * h + i] = xb[32 * h + 2 * i];
                o[1 * 32 + 8 * h + i] = xb[32 * h + 2 * i + 16];
                o[2 * 32 + 8 * h + i] = xb[32 * h + 2 * i + 1];
                o[3 * 32 + 8 * h + i] = xb[32 * h + 2 * i + 17];
            }
    }
}

static inline __m512i q4_block_dot(const uint8_t *p, const int16_t *xq) {
    const __m512i low = _mm512_set1_epi16(0x0F), u = _mm512_loadu_si512(p);
    const __m512i v0 = _mm512_and_si512(u, low), v1 = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
    const __m512i v2 = _mm512_and_si512(_mm512_srli_epi16(u, 8), low), v3 = _mm512_srli_epi16(u, 12);
    __m512i s = _mm512_madd_epi16(v0, _mm512_loadu_si512(xq));
#if defined(__AVX512VNNI__)
    s = _mm512_dpwssd_epi32(s, v1, _mm512_loadu_si512(xq + 32));
    s = _mm512_dpwssd_epi32(s, v2, _mm512_loadu_si512(xq + 64));
    s = _mm512_dpwssd_epi32(s, v3, _mm512_loadu_si512(xq + 96));
#else
    s = _mm512_add_epi32(s, _mm512_madd_epi16(v1, _mm512_loadu_si512(xq + 32)));
    s = _mm512_add_epi32(s, _mm512_madd_epi16(v2, _mm512_loadu_si512(xq + 64)));
    s = _mm512_add_epi32(s, _mm512_madd_epi16(v3, _mm512_loadu_si512(xq + 96)));
#endif
    return s; /* lanes 4h..4h+3: group h's partial sums */
}

static inline float q4_row512(const uint8_t *wn, const float *dn, const float *mn, const int16_t *x16,
                              const int16_t *xp, const float *dx, const float *xs, long G) {
    float sc[CHUNK], macc = 0.f;
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m256 tail = _mm256_setzero_ps();
    _mm_prefetch((const char *)(dn + AHEAD / 2), _MM_HINT_T0);
    _mm_prefetch((const char *)(mn + AHEAD / 2), _MM_HINT_T0);
    for (long g0 = 0; g0 < G; g0 += CHUNK) { /* CHUNK is a multiple of BLOCK: blocks never straddle */
        const long len = G - g0 < CHUNK ? G - g0 : CHUNK;
        macc += row_scales(dn + g0, mn + g0, dx + g0, xs + g0, sc, len);
        long j = 0;
        for (; j + 2 * BLOCK <= len; j += 2 * BLOCK) {
            const long g = g0 + j;
            _mm_prefetch((const char *)(wn + g * 16 + AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(wn + g * 16 + AHEAD + 64), _MM_HINT_T0);
            const __m512 s0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sc + j)));
            const __m512 s1 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sc + j + BLOCK)));
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_block_dot(wn + g * 16, xp + g * GROUP)), s0, acc0);
            acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_block_dot(wn + g * 16 + 64, xp + (g + BLOCK) * GROUP)), s1,
                                   acc1);
        }
        for (; j + BLOCK <= len; j += BLOCK) {
            const long g = g0 + j;
            const __m512 s0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(sc + j)));
            acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_block_dot(wn + g * 16, xp + g * GROUP)), s0, acc0);
        }
        for (; j < len; j++) /* the last groups of a row not a multiple of BLOCK: x in its own order */
            tail = _mm256_fmadd_ps(q4_group(wn + (g0 + j) * 16, x16 + (g0 + j) * GROUP), _mm256_broadcast_ss(sc + j), tail);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + hsum(tail) + macc;
}
#endif

static inline float q8_row(const int8_t *wn, const int16_t *x16, const float *dx, long G) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    long g = 0;
    for (; g + 2 <= G; g += 2) {
        _mm_prefetch((const char *)(wn + g * GROUP + AHEAD), _MM_HINT_T0);
        acc0 = _mm256_fmadd_ps(q8_group(wn + g * GROUP, x16 + g * GROUP), _mm256_broadcast_ss(dx + g), acc0);
        acc1 = _mm256_fmadd_ps(q8_group(wn + g * GROUP + GROUP, x16 + g * GROUP + GROUP), _mm256_broadcast_ss(dx + g + 1), acc1);
    }
    if (g < G) acc0 = _mm256_fmadd_ps(q8_group(wn + g * GROUP, x16 + g * GROUP), _mm256_broadcast_ss(dx + g), acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* Returns 0, or -1 when out of memory. K must be a multiple of 32; x and y are bf16 with ``bf16``,
 * else fp32. */
int tp_gemv_q4(const uint8_t *w, const float *d, const float *m, const void *x, void *y,
               long M, long K, long N, int threads, int bf16)
{
    int16_t *x16; float *dx, *xs;
    if (quantize_rows(x, bf16, M, K, &x16, &dx, &xs)) return -1;
    const long G = K / GROUP;
    if (M == 1) {
#if defined(__AVX512BW__)
        int16_t *xp = malloc(sizeof(int16_t) * (G / BLOCK) * BLOCK * GROUP + 64);
        if (!xp) { free(x16); free(dx); return -1; }
        interleave_x(x16, xp, G / BLOCK);
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (long n = 0; n < N; n++)
            put(y, n, q4_row512(w + n * (K / 2), d + n * G, m + n * G, x16, xp, dx, xs, G), bf16);
        free(xp);
#else
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (long n = 0; n < N; n++) put(y, n, q4_row(w + n * (K / 2), d + n * G, m + n * G, x16, dx, xs, G), bf16);
#endif
        free(x16); free(dx);
        return 0;
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++) {
        const uint8_t *wn = w + n * (K / 2);
        const float *dn = d + n * G, *mn = m + n * G;
        for (long r0 = 0; r0 < M; r0 += TILE) {
            const long R = M - r0 < TILE ? M - r0 : TILE;
            const int16_t *x0 = x16 + r0 * K;
            const float *dx0 = dx + r0 * G, *xs0 = xs + r0 * G;
            void *y0 = bf16 ? (void *)((uint16_t *)y + r0 * N) : (void *)((float *)y + r0 * N);
            /* constant row counts, so each tile keeps its accumulators in registers */
            switch (R) {
            case 1: q4_tile(wn, dn, mn, x0, dx0, xs0, y0, bf16, 1, K, N, n); break;
            case 2: q4_tile(wn, dn, mn, x0, dx0, xs0, y0, bf16, 2, K, N, n); break;
            case 3: q4_tile(wn, dn, mn, x0, dx0, xs0, y0, bf16, 3, K, N, n); break;
            default: q4_tile(wn, dn, mn, x0, dx0, xs0, y0, bf16, TILE, K, N, n); break;
            }
        }
    }
    free(x16); free(dx);
    return 0;
}

int tp_gemv_q8(const int8_t *w, const float *s, const void *x, void *y, long M, long K, long N, int threads,
               int bf16)
{
    int16_t *x16; float *dx, *xs;
    if (quantize_rows(x, bf16, M, K, &x16, &dx, &xs)) return -1;
    const long G = K / GROUP;
    if (M == 1) {
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (long n = 0; n < N; n++) put(y, n, s[n] * q8_row(w + n * K, x16, dx, G), bf16);
        free(x16); free(dx);
        return 0;
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++) {
        const int8_t *wn = w + n * K;
        for (long r0 = 0; r0 < M; r0 += TILE) {
            const long R = M - r0 < TILE ? M - r0 : TILE;
            const int16_t *x0 = x16 + r0 * K;
            const float *dx0 = dx + r0 * G;
            void *y0 = bf16 ? (void *)((uint16_t *)y + r0 * N) : (void *)((float *)y + r0 * N);
            switch (R) {
            case 1: q8_tile(wn, s[n], x0, dx0, y0, bf16, 1, K, N, n); break;
            case 2: q8_tile(wn, s[n], x0, dx0, y0, bf16, 2, K, N, n); break;
            case 3: q8_tile(wn, s[n], x0, dx0, y0, bf16, 3, K, N, n); break;
            default: q8_tile(wn, s[n], x0, dx0, y0, bf16, TILE, K, N, n); break;
            }
        }
    }
    free(x16); free(dx);
    return 0;
}
