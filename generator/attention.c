/* Decode attention read straight from the paged KV pool: one query token per row.
 *
 * Built into the same library as gemv.c (generator/gemv.py). The torch ops it replaces gather
 * each row's K blocks into a new tensor, multiply in batched matmuls far too small for their
 * fixed costs (bf16 ones go through oneDNN per call) and take V through an embedding_bag: at 32
 * rows that was about a fifth of a step on a 2-core AMX Xeon (bench/RESULTS.md, "issue 21,
 * part 11"). Here each (row, kv head) pair is one task: the scores of the group's query heads
 * against every attended position, read from the row's blocks in place, a softmax in fp32, then
 * the weighted sum of V rows, also in place. Nothing is gathered or allocated per position.
 *
 * Layout (generator/kvcache.py): one layer's K (and V) is [G, num_blocks, BLOCK, hd]; q and out
 * are [B, H, hd], query head h reading kv head h / (H / G); tables [B, width] block ids;
 * positions [B] the last position each row attends (its own, written this step). K, V, q and out
 * share one dtype: fp32, or bf16 with ``bf16`` (math in fp32 either way).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows.h"

#define BLOCK 16 /* generator.kvcache.BLOCK_SIZE */
#define SERIAL_WORK (1L << 17) /* multiply-adds below which one thread beats waking the team */

/* e^x for x <= 0, 8 lanes (Cephes' polynomial, as avx_mathfun): ~1e-7 relative, and libm's
 * expf one position at a time was the largest part of the kernel's time. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* The sums of a[0..7]'s lanes, as one vector (no horizontal sum per position). */
static inline __m256 sums8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* Scores of one query (qf, fp32) against 8 consecutive K rows. */
static inline __m256 scores8(const float *qf, const char *k8, long hd, long elt, int bf16) {
    __m256 a[8];
    for (int p = 0; p < 8; p++) a[p] = _mm256_setzero_ps();
    for (long i = 0; i < hd; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qf + i);
        for (int p = 0; p < 8; p++) a[p] = _mm256_fmadd_ps(qv, load8(k8 + p * hd * elt, i, bf16), a[p]);
    }
    return sums8(a);
}

/* acc[0..8*NC) += Σ_t w[t] · V row t (a head's weights over n rows of one block), NC 8-lane chunks. */
static inline __attribute__((always_inline)) void weigh(float *acc, const float *w, const char *vb, long n, long hd,
                                                       long elt, int bf16, const long NC) {
    for (long c0 = 0; c0 < hd; c0 += 8 * NC) {
        __m256 a[8];
        for (long c = 0; c < NC; c++) a[c] = _mm256_loadu_ps(acc + c0 + 8 * c);
        for (long p = 0; p < n; p++) {
            const __m256 wp = _mm256_set1_ps(w[p]);
            for (long c = 0; c < NC; c++) a[c] = _mm256_fmadd_ps(wp, load8(vb + p * hd * elt, c0 + 8 * c, bf16), a[c]);
        }
        for (long c = 0; c < NC; c++) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
    }
}

/* One (row b, kv head g): the R = H / G query heads of g's group over positions 0..T-1. Scores
 * are taken for whole blocks (a block's unused positions are allocated, their scores ignored). */
static void one_task(const void *q, const char *k, const char *v, const int64_t *table, long T, void *out,
                     long b, long g, long H, long R, long hd, long nblocks, float scale, int bf16, float *buf) {
    const long elt = bf16 ? 2 : 4, S = (T + BLOCK - 1) / BLOCK * BLOCK, blocks = S / BLOCK;
    float *qf = buf, *acc = buf + R * hd, *s = buf + 2 * R * hd; /* [R, hd], [R, hd], [R, S] */
    const __m256 sc = _mm256_set1_ps(scale);
    for (long r = 0; r < R; r++)
        for (long i = 0; i < hd; i += 8)
            _mm256_storeu_ps(qf + r * hd + i, _mm256_mul_ps(sc, load8(q, (b * H + g * R + r) * hd + i, bf16)));
    const long head = g * nblocks;
    for (long j = 0; j < blocks; j++) {
        const char *kb = k + (head + table[j]) * BLOCK * hd * elt;
        for (long r = 0; r < R; r++)
            for (int p0 = 0; p0 < BLOCK; p0 += 8)
                _mm256_storeu_ps(s + r * S + j * BLOCK + p0, scores8(qf + r * hd, kb + p0 * hd * elt, hd, elt, bf16));
    }
    for (long r = 0; r < R; r++) {
        float *sr = s + r * S;
        for (long t = T; t < S; t++) sr[t] = -INFINITY;
        __m256 mv = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
        for (long t = 0; t < S; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + t));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
        for (long t = 0; t < S; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + t), mx));
            _mm256_storeu_ps(sr + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        const __m256 inv = _mm256_set1_ps(1.f / hsum(sum));
        for (long t = 0; t < S; t += 8) _mm256_storeu_ps(sr + t, _mm256_mul_ps(_mm256_loadu_ps(sr + t), inv));
    }
    memset(acc, 0, sizeof(float) * R * hd);
    for (long j = 0; j < blocks; j++) {
        const char *vb = v + (head + table[j]) * BLOCK * hd * elt;
        const long n = T - j * BLOCK < BLOCK ? T - j * BLOCK : BLOCK;
        for (long r = 0; r < R; r++) {
            if (hd % 64 == 0) weigh(acc + r * hd, s + r * S + j * BLOCK, vb, n, hd, elt, bf16, 8);
            else weigh(acc + r * hd, s + r * S + j * BLOCK, vb, n, hd, elt, bf16, 1);
        }
    }
    for (long r = 0; r < R; r++)
        for (long i = 0; i < hd; i++) put(out, (b * H + g * R + r) * hd + i, acc[r * hd + i], bf16);
}

/* Returns 0, or -1 when out of memory. hd must be a multiple of 8, H of G, and every
 * positions[b] below width * BLOCK (the op checks). */
int tp_paged_attention(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *positions,
                       void *out, long B, long H, long G, long hd, long nblocks, long width, float scale,
                       int threads, int bf16) {
    const long R = H / G, tasks = B * G, most = width * BLOCK;
    long work = 0;
    for (long b = 0; b < B; b++) work += (positions[b] + 1) * H * hd * 2;
    const int team = work < SERIAL_WORK || tasks < 2 ? 1 : threads;
    int failed = 0;
    #pragma omp parallel num_threads(team) reduction(|: failed)
    {
        float *buf = malloc(sizeof(float) * (2 * R * hd + R * most));  /* most: a multiple of BLOCK */
        if (!buf) failed = 1;
        #pragma omp for schedule(static)
        for (long task = 0; task < tasks; task++) {
            if (!buf) continue;
            const long b = task / G, g = task % G;
            one_task(q, k, v, tables + b * width, positions[b] + 1, out, b, g, H, R, hd, nblocks, scale, bf16, buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* This step's K and V rows into one layer's pool, kv [2, G, positions, hd] (positions = blocks *
 * BLOCK): row b's head g goes to position slots[b]. k and v [B, G, hd] at strides (kb, kg) and (vb, vg)
 * elements of ``elt`` bytes, each head's hd contiguous: the torch code copied them into one tensor
 * (cat) and that into the pool (index_copy_), two ops of ~8-15 us at one row. */
void tp_kv_write(char *kv, const char *k, const char *v, long kb, long kg, long vb, long vg, const int64_t *slots,
                 long B, long G, long positions, long hd, long elt) {
    const long row = hd * elt;
    for (long b = 0; b < B; b++)
        for (long g = 0; g < G; g++) {
            memcpy(kv + ((g * positions) + slots[b]) * row, k + (b * kb + g * kg) * elt, row);
            memcpy(kv + (((G + g) * positions) + slots[b]) * row, v + (b * vb + g * vg) * elt, row);
        }
}
