/* Quantized projections for few rows on AVX2: y[M, N] = x[M, K] @ W.T, W int4 or int8.
 *
 * Built once per x86 level by generator/kernels/build.py (cc -O3 -mavx2 -mfma -fopenmp, plus -mavx512f
 * -mavx512bw [-mavx512vnni] for the AVX-512 levels: the one-row loops then run on 512-bit vectors, simd.h).
 * Each row of x is quantized to int16 per group of 32 (scale = max|x| / 32767, so the error is ~1e-5 of
 * the group's largest value, far below a bf16 cast's), and each group's dot product is exact in
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
#include "simd.h"

#define GROUP 32
#define TILE 4 /* rows of x that share one pass over the weight */

/* x[M, K] -> x16 (int16 per group of 32), dx (each group's scale), xs (each group's float sum).
 * Vectorized: it runs once per projection call, and per element in C it was ~4 us of a one-row
 * call's ~11 us fixed cost. */
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

/* One row of x (a one-stream decode step): ROWS rows of W a step. Not the tiles above with R = 1:
 * there each group's scale is a scalar multiply and broadcast on one accumulator's chain, and each
 * output its own reduction. Here the rows share each load of x and of its group scales, a group's
 * scale is a broadcast load, a row's offset term (sum of m * xs) is 8 or 16 groups an instruction, the
 * rows' accumulators are summed by one reduction, and the weights ahead are prefetched. Row by row, a
 * row of K = 576 (18 groups) spent about two thirds of its time outside its dot products: four rows at
 * a time, the AVX-512 build runs those shapes ~1.4x faster from cache and ~1.1x from memory on an AMX
 * Xeon (python -m bench.gemvrows measures it). */
#define ROWS 4 /* rows of W per step */
#define AHEAD 2048 /* bytes of weights prefetched ahead, at least: the next rows of this thread's share */

static inline void put_rows(void *y, long n, __m128 v, int R, int bf16) {
    float o[ROWS];
    _mm_storeu_ps(o, v);
    for (int r = 0; r < R; r++) put(y, n + r, o[r], bf16);
}

/* each of the N / ROWS steps, and a last one of the N % ROWS rows left: R a constant in each call */
#define FOR_ROWS(N, threads, CALL)                                    \
    _Pragma("omp parallel for schedule(static) num_threads(threads)") \
    for (long i = 0; i < ((N) + ROWS - 1) / ROWS; i++) {              \
        const long n = i * ROWS;                                      \
        switch ((N) - n < ROWS ? (N) - n : ROWS) {                    \
        case 1: CALL(1); break;                                       \
        case 2: CALL(2); break;                                       \
        case 3: CALL(3); break;                                       \
        default: CALL(ROWS); break;                                   \
        }                                                             \
    }

/* The one-row loops are written once against simd.h's vectors, VF_LANES floats wide: 8 on AVX2, 16 where
 * the library is built with AVX-512 (generator/kernels/levels.py). */

/* the same for int8 rows of W (scale s[n]): one group of 32 a step, x in its own order, as XV vectors of int16 */
#define XV (GROUP / (2 * VF_LANES))
static inline __attribute__((always_inline)) void q8_rows(
    const int8_t *w, const float *s, const int16_t *x16, const float *dx, long K, long n, int R, void *y, int bf16)
{
    const long G = K / GROUP, ahead = R * K > AHEAD ? R * K : AHEAD;
    vf acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = vf_zero();
    for (long g = 0; g < G; g++) {
        vi xv[XV];
        for (int j = 0; j < XV; j++) xv[j] = vi_load(x16 + g * GROUP + j * 2 * VF_LANES);
        const vf dxg = vf_set1(dx[g]);
        for (int r = 0; r < R; r++) {
            const int8_t *wr = w + (n + r) * K + g * GROUP;
            _mm_prefetch((const char *)(wr + ahead), _MM_HINT_T0);
            vi dot = vi_madd16(vi_widen_i8(wr), xv[0]);
            for (int j = 1; j < XV; j++) dot = vi_add32(dot, vi_madd16(vi_widen_i8(wr + j * 2 * VF_LANES), xv[j]));
            acc[r] = vf_fma(vf_from_i32(dot), dxg, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) acc[r] = vf_mul(acc[r], vf_set1(s[n + r]));
    put_rows(y, n, vf_sums4(acc), R, bf16);
}

/* The int4 one-row loops need no byte shuffle. Read as lanes of 16 bits, the bytes 2i, 2i+1 of a group
 * hold q[2i], q[2i+16] (low, high nibble of the first) and q[2i+1], q[2i+17]: a mask and three shifts give
 * the four nibbles of every lane, where the tiles above spend two cross-lane widenings per group. x is
 * laid out to match, once per call (interleave_x), in blocks of BLOCK groups: one vector of weights (two
 * groups on AVX2, four on AVX-512). Each group owns four of a block's int32 sums, so a block's scales are
 * spread over them (vf_spread4). A row whose groups are not a multiple of BLOCK ends with a shorter block,
 * read into a zeroed vector. */
#define BLOCK (VF_LANES / 4) /* groups per step */
#define LANES (8 * BLOCK) /* 16-bit lanes in a vector of one block */

/* xp, per block of BLOCK groups, 4 vectors of LANES: X0[8h + i] = x[32h + 2i], X1 = x[32h + 2i + 16],
 * X2 = x[32h + 2i + 1], X3 = x[32h + 2i + 17] (h the group in the block, i < 8); a last block of
 * fewer groups is padded with zeros */
static void interleave_x(const int16_t *x16, int16_t *xp, long G) {
    for (long b = 0; b * BLOCK < G; b++) {
        const int16_t *xb = x16 + b * BLOCK * GROUP;
        const long groups = G - b * BLOCK < BLOCK ? G - b * BLOCK : BLOCK;
        int16_t *o = xp + b * BLOCK * GROUP;
        memset(o, 0, sizeof(int16_t) * BLOCK * GROUP);
        for (int h = 0; h < groups; h++)
            for (int i = 0; i < 8; i++) {
                o[0 * LANES + 8 * h + i] = xb[32 * h + 2 * i];
                o[1 * LANES + 8 * h + i] = xb[32 * h + 2 * i + 16];
                o[2 * LANES + 8 * h + i] = xb[32 * h + 2 * i + 1];
                o[3 * LANES + 8 * h + i] = xb[32 * h + 2 * i + 17];
            }
    }
}

/* the int32 sums of a block's weights u with xq: lanes 4h..4h+3 group h's */
static inline vi q4_block_dot(vi u, const vi *xq) {
    const vi low = vi_set1_16(0x0F);
    const vi v0 = vi_and(u, low), v1 = vi_and(vi_srl16(u, 4), low);
    const vi v2 = vi_and(vi_srl16(u, 8), low), v3 = vi_srl16(u, 12);
    return vi_dpwssd(vi_dpwssd(vi_dpwssd(vi_madd16(v0, xq[0]), v1, xq[1]), v2, xq[2]), v3, xq[3]);
}

/* acc[r] += the dot of row n + r of W with x over the block at group g, r < R; ``groups`` (BLOCK, or fewer for a
 * last block) and R are constants where inlined, so the loop has no branch per row */
static inline __attribute__((always_inline)) void q4_step(
    const uint8_t *w, const float *d, const int16_t *xp, const float *dx, long G, long n, int R, long g,
    const long groups, vf *acc)
{
    vi xq[4];
    for (int j = 0; j < 4; j++) xq[j] = vi_load(xp + g * GROUP + j * LANES);
    const vf dxv = vf_spread4(dx + g, groups);
    for (int r = 0; r < R; r++) {
        const uint8_t *wr = w + ((n + r) * G + g) * 16;
        const vf dot = vf_from_i32(q4_block_dot(vi_load_first_bytes(wr, groups * 16), xq));
        acc[r] = vf_fma(vf_mul(dot, dxv), vf_spread4(d + (n + r) * G + g, groups), acc[r]);
    }
}

/* y[n..n+R) for one row of x, R <= ROWS (a constant where inlined): x as xp, its group scales dx and sums xs */
static inline __attribute__((always_inline)) void q4_rows(
    const uint8_t *w, const float *d, const float *m, const int16_t *xp, const float *dx, const float *xs,
    long G, long n, int R, void *y, int bf16)
{
    const long ahead = R * G * 16 > AHEAD ? R * G * 16 : AHEAD; /* at least the same row of the next step */
    vf acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = vf_zero();
    for (long g = 0; g < G; g += VF_LANES) { /* the offset term: the sum of m * xs */
        const vf xsv = vf_load_first(xs + g, G - g);
        for (int r = 0; r < R; r++) acc[r] = vf_fma(vf_load_first(m + (n + r) * G + g, G - g), xsv, acc[r]);
    }
    /* Where a shorter last block is a masked load (VF_MASKED, AVX-512) it is one more step of the loop (two
     * inlined loops ran ~6 % slower there); elsewhere the loop's blocks are all full, no test per row, and
     * the last one follows it. */
    const long body = VF_MASKED ? G : G - G % BLOCK;
    long g = 0;
    for (; g < body; g += BLOCK) {
        if (!((g * 16) & 63)) /* a cache line of each row */
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + ((n + r) * G + g) * 16 + ahead), _MM_HINT_T0);
        q4_step(w, d, xp, dx, G, n, R, g, VF_MASKED && G - g < BLOCK ? G - g : BLOCK, acc);
    }
    if (g < G) q4_step(w, d, xp, dx, G, n, R, g, G - g, acc);
    put_rows(y, n, vf_sums4(acc), R, bf16);
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
        int16_t *xp = malloc(sizeof(int16_t) * ((G + BLOCK - 1) / BLOCK) * BLOCK * GROUP);
        if (!xp) { free(x16); free(dx); return -1; }
        interleave_x(x16, xp, G);
#define Q4_ROWS(R) q4_rows(w, d, m, xp, dx, xs, G, n, R, y, bf16)
        FOR_ROWS(N, threads, Q4_ROWS)
        free(xp);
#undef Q4_ROWS
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
#define Q8_ROWS(R) q8_rows(w, s, x16, dx, K, n, R, y, bf16)
        FOR_ROWS(N, threads, Q8_ROWS)
#undef Q8_ROWS
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

/* The int4 weight as floats, y[N, K] (bf16 with ``bf16``, else fp32): a many-row matmul's weight where the
 * float copy was not kept (TOKENPIPE_FLOAT_WEIGHTS). One pass, 8 weights a vector: w = q * d + m. */
int tp_dequant_q4(const uint8_t *w, const float *d, const float *m, void *y, long K, long N, int threads, int bf16)
{
    const long G = K / GROUP;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++) {
        for (long g = 0; g < G; g++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(w + n * (K / 2) + g * 16));
            const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
            const __m256 dg = _mm256_set1_ps(d[n * G + g]), mg = _mm256_set1_ps(m[n * G + g]);
            const long at = n * K + g * GROUP;
            /* byte j holds q[j] (low nibble) and q[j + 16] (high) */
            const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int p = 0; p < 4; p++)
                store8(y, at + 8 * p, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[p])), dg, mg), bf16);
        }
    }
    return 0;
}

/* The int8 weight as floats, y[N, K] (bf16 with ``bf16``, else fp32): w = q * s[n]. */
int tp_dequant_q8(const int8_t *w, const float *s, void *y, long K, long N, int threads, int bf16)
{
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++) {
        const __m256 sn = _mm256_set1_ps(s[n]);
        for (long k = 0; k < K; k += 8) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(w + n * K + k));
            store8(y, n * K + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), sn), bf16);
        }
    }
    return 0;
}
