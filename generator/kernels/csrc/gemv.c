/* Quantized projections for few rows on AVX2: y[M, N] = x[M, K] @ W.T, W int4 or int8.
 *
 * Built at start-up by generator/kernels/build.py (cc -O3 -mavx2 -mfma -fopenmp, plus -mavx512f -mavx512bw
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

/* the lane sums of h[0..ROWS) */
static inline __m128 reduce_rows(const __m256 *h) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

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

/* lanes below ``left`` (of 8) */
static inline __m256i first_lanes(long left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* the same for int8 rows of W (scale s[n]) */
static inline __attribute__((always_inline)) void q8_rows256(
    const int8_t *w, const float *s, const int16_t *x16, const float *dx, long K, long n, int R, void *y, int bf16)
{
    const long G = K / GROUP, ahead = R * K > AHEAD ? R * K : AHEAD;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (long g = 0; g < G; g++) {
        const __m256i xa = _mm256_loadu_si256((const __m256i *)(x16 + g * GROUP));
        const __m256i xb = _mm256_loadu_si256((const __m256i *)(x16 + g * GROUP + 16));
        const __m256 dxg = _mm256_broadcast_ss(dx + g);
        for (int r = 0; r < R; r++) {
            const int8_t *wr = w + (n + r) * K + g * GROUP;
            _mm_prefetch((const char *)(wr + ahead), _MM_HINT_T0);
            __m256i wa, wb;
            q8_unpack(wr, &wa, &wb);
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(wa, xa), _mm256_madd_epi16(wb, xb));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dxg, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) acc[r] = _mm256_mul_ps(acc[r], _mm256_set1_ps(s[n + r]));
    put_rows(y, n, reduce_rows(acc), R, bf16);
}

/* The int4 one-row loops need no byte shuffle. Read as lanes of 16 bits, the bytes 2i, 2i+1 of a group
 * hold q[2i], q[2i+16] (low, high nibble of the first) and q[2i+1], q[2i+17]: a mask and three shifts give
 * the four nibbles of every lane, where the tiles above spend two cross-lane widenings per group. x is
 * laid out to match, once per call (interleave_x), in blocks of BLOCK groups: one vector of weights (two
 * groups on AVX2, four on AVX-512). Each group owns four of a block's int32 sums, so a block's scales are
 * spread over them. A row whose groups are not a multiple of BLOCK ends with a shorter block: on AVX-512
 * read under a mask, on AVX2 one group's 16 bytes in a zeroed vector. */
#if defined(__AVX512BW__)
#define BLOCK 4 /* groups per step */
#else
#define BLOCK 2
#endif
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

#if !defined(__AVX512BW__)
/* the int32 sums of a block's weights u with xq: lanes 4h..4h+3 group h's */
static inline __m256i q4_block_dot(__m256i u, const __m256i *xq) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    const __m256i v0 = _mm256_and_si256(u, low), v1 = _mm256_and_si256(_mm256_srli_epi16(u, 4), low);
    const __m256i v2 = _mm256_and_si256(_mm256_srli_epi16(u, 8), low), v3 = _mm256_srli_epi16(u, 12);
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(v0, xq[0]), _mm256_madd_epi16(v1, xq[1])),
                            _mm256_add_epi32(_mm256_madd_epi16(v2, xq[2]), _mm256_madd_epi16(v3, xq[3])));
}

/* p[0] on lanes 0-3, p[1] on 4-7 (0 where the block has one group): a block's scales over its sums */
static inline __m256 spread2(const float *p, long groups) {
    return _mm256_blend_ps(_mm256_broadcast_ss(p), groups == BLOCK ? _mm256_broadcast_ss(p + 1) : _mm256_setzero_ps(),
                           0xF0);
}

/* acc[r] += the dot of row n + r of W with x over the block at group g, r < R; ``groups`` (BLOCK, or 1 for a
 * last odd group) and R are constants where inlined, so the loop has no branch per row */
static inline __attribute__((always_inline)) void q4_step256(
    const uint8_t *w, const float *d, const int16_t *xp, const float *dx, long G, long n, int R, long g, int groups,
    __m256 *acc)
{
    __m256i xq[4];
    for (int j = 0; j < 4; j++) xq[j] = _mm256_loadu_si256((const __m256i *)(xp + g * GROUP + j * LANES));
    const __m256 dxv = spread2(dx + g, groups);
    for (int r = 0; r < R; r++) {
        const uint8_t *wr = w + ((n + r) * G + g) * 16;
        const __m256i u = groups == BLOCK ? _mm256_loadu_si256((const __m256i *)wr)
                                          : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)wr));
        const __m256 dot = _mm256_cvtepi32_ps(q4_block_dot(u, xq));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dot, dxv), spread2(d + (n + r) * G + g, groups), acc[r]);
    }
}

/* y[n..n+R) for one row of x on AVX2, R <= ROWS (a constant where inlined): x as xp, its group scales dx
 * and sums xs */
static inline __attribute__((always_inline)) void q4_rows256(
    const uint8_t *w, const float *d, const float *m, const int16_t *xp, const float *dx, const float *xs,
    long G, long n, int R, void *y, int bf16)
{
    const long ahead = R * G * 16 > AHEAD ? R * G * 16 : AHEAD; /* at least the same row of the next step */
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (long g = 0; g < G; g += 8) { /* the offset term: the sum of m * xs */
        const __m256i k = first_lanes(G - g);
        const __m256 xsv = _mm256_maskload_ps(xs + g, k);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(m + (n + r) * G + g, k), xsv, acc[r]);
    }
    long g = 0;
    for (; g + BLOCK <= G; g += BLOCK) {
        if (!(g & 2)) /* a cache line of each row every two steps */
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + ((n + r) * G + g) * 16 + ahead), _MM_HINT_T0);
        q4_step256(w, d, xp, dx, G, n, R, g, BLOCK, acc);
    }
    if (g < G) q4_step256(w, d, xp, dx, G, n, R, g, 1, acc);
    put_rows(y, n, reduce_rows(acc), R, bf16);
}

#else
/* The one-row loops on AVX-512 (built where the CPU has it, generator/kernels/build.py): int4 four groups (64
 * bytes, 128 weights) a step, one permute spreading four groups' scales over their sums. */

static inline __m512i q4_block_dot(__m512i u, const int16_t *xq) {
    const __m512i low = _mm512_set1_epi16(0x0F);
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

/* the lane sums of a[0..ROWS) */
static inline __m128 reduce_rows512(const __m512 *a) {
    __m256 h[ROWS];
    for (int r = 0; r < ROWS; r++)
        h[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r]), 1)));
    return reduce_rows(h);
}

/* y[n..n+R) for one row of x, R <= ROWS (a constant where inlined): x as xp, its group scales dx and sums xs */
static inline __attribute__((always_inline)) void q4_rows512(
    const uint8_t *w, const float *d, const float *m, const int16_t *xp, const float *dx, const float *xs,
    long G, long n, int R, void *y, int bf16)
{
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const long ahead = R * G * 16 > AHEAD ? R * G * 16 : AHEAD; /* at least the same row of the next step */
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (long g = 0; g < G; g += 16) { /* the offset term: the sum of m * xs */
        const __mmask16 k = G - g >= 16 ? 0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        const __m512 xsv = _mm512_maskz_loadu_ps(k, xs + g);
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + (n + r) * G + g), xsv, acc[r]);
    }
    for (long g = 0; g < G; g += BLOCK) {
        const long groups = G - g < BLOCK ? G - g : BLOCK;
        const __mmask64 kw = groups == BLOCK ? ~(__mmask64)0 : ((__mmask64)1 << (groups * 16)) - 1;
        const __mmask16 kd = (__mmask16)((1u << groups) - 1);
        const __m512 dxv = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(kd, dx + g));
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = w + ((n + r) * G + g) * 16;
            _mm_prefetch((const char *)(wr + ahead), _MM_HINT_T0);
            const __m512 dot = _mm512_cvtepi32_ps(q4_block_dot(_mm512_maskz_loadu_epi8(kw, wr), xp + g * GROUP));
            const __m512 dr = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(kd, d + (n + r) * G + g));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dxv), dr, acc[r]);
        }
    }
    put_rows(y, n, reduce_rows512(acc), R, bf16);
}

/* the same for int8 rows of W (scale s[n]): one group of 32 a step, x in its own order */
static inline __attribute__((always_inline)) void q8_rows512(
    const int8_t *w, const float *s, const int16_t *x16, const float *dx, long K, long n, int R, void *y, int bf16)
{
    const long G = K / GROUP, ahead = R * K > AHEAD ? R * K : AHEAD;
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        const __m512i xg = _mm512_loadu_si512(x16 + g * GROUP);
        const __m512 dxg = _mm512_set1_ps(dx[g]);
        for (int r = 0; r < R; r++) {
            const int8_t *wr = w + (n + r) * K + g * GROUP;
            _mm_prefetch((const char *)(wr + ahead), _MM_HINT_T0);
            const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)wr));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(wv, xg)), dxg, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) acc[r] = _mm512_mul_ps(acc[r], _mm512_set1_ps(s[n + r]));
    put_rows(y, n, reduce_rows512(acc), R, bf16);
}

#endif

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
#if defined(__AVX512BW__)
#define Q4_ROWS(R) q4_rows512(w, d, m, xp, dx, xs, G, n, R, y, bf16)
#else
#define Q4_ROWS(R) q4_rows256(w, d, m, xp, dx, xs, G, n, R, y, bf16)
#endif
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
#if defined(__AVX512BW__)
#define Q8_ROWS(R) q8_rows512(w, s, x16, dx, K, n, R, y, bf16)
#else
#define Q8_ROWS(R) q8_rows256(w, s, x16, dx, K, n, R, y, bf16)
#endif
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
