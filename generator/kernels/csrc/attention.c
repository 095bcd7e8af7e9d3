/* Decode attention read straight from the paged KV pool: one query token per row.
 *
 * Built into the same library as gemv.c (generator/kernels/build.py). The torch ops it replaces gather
 * each row's K blocks into a new tensor, multiply in batched matmuls far too small for their
 * fixed costs (bf16 ones go through oneDNN per call) and take V through an embedding_bag: at 32
 * rows that was about a fifth of a step on a 2-core AMX Xeon. Here each (row, kv head) pair is one task: the scores of the group's query heads
 * against every attended position, read from the row's blocks in place, a softmax in fp32, then
 * the weighted sum of V rows, also in place. Nothing is gathered or allocated per position.
 *
 * Layout (generator/model/kvcache.py): one layer's K (and V) is [G, num_blocks, BLOCK, hd]; q and out
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
#include "simd.h"

#define BLOCK 16 /* generator.model.kvcache.BLOCK_SIZE */
#define SERIAL_WORK (1L << 17) /* multiply-adds below which one thread beats waking the team */

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

/* The group's query heads together: each K and V row is read (and widened from bf16) once for up to
 * TILE_HEADS heads instead of once per head, TILE_POSITIONS positions scored at a time, in vectors of
 * VW floats (simd.h: 16 where built with AVX-512, else 8). hd must be a multiple of VW: block_scores and
 * block_weigh below take the other cases one head at a time. The tiles' sums stay in registers:
 * heads x positions score sums, heads x vectors of V. */
#define TILE_HEADS 3
#define TILE_POSITIONS 4
#define TILE_VECTORS 4

#define VW VF_LANES

/* s[r * S + p] = qf[r] · K row p of kp, for p < TILE_POSITIONS and the NH heads at qf (constant: registers) */
static inline __attribute__((always_inline)) void scores_tile(const float *qf, const char *kp, long hd, long elt,
                                                             int bf16, float *s, long S, const int NH) {
    vf a[TILE_HEADS][TILE_POSITIONS];
    for (int r = 0; r < NH; r++)
        for (int p = 0; p < TILE_POSITIONS; p++) a[r][p] = vf_zero();
    for (long i = 0; i < hd; i += VW) {
        vf qv[TILE_HEADS];
        for (int r = 0; r < NH; r++) qv[r] = vf_load(qf + r * hd + i);
        for (int p = 0; p < TILE_POSITIONS; p++) {
            const vf kv = vf_load_row(kp + p * hd * elt, i, bf16);
            for (int r = 0; r < NH; r++) a[r][p] = vf_fma(qv[r], kv, a[r][p]);
        }
    }
    for (int r = 0; r < NH; r++) _mm_storeu_ps(s + r * S, vf_sums4(a[r]));
}

/* acc[r * hd + c0 ..] += Σ_t w[r * S + t] · V row t (vectors c0 / VW .. + N), t < n, for NH heads */
static inline __attribute__((always_inline)) void weigh_tile(float *acc, const float *w, long S, const char *vb,
                                                            long n, long hd, long elt, int bf16, long c0,
                                                            const int NH, const int N) {
    vf a[TILE_HEADS][TILE_VECTORS];
    for (int r = 0; r < NH; r++)
        for (int c = 0; c < N; c++) a[r][c] = vf_load(acc + r * hd + c0 + c * VW);
    for (long t = 0; t < n; t++) {
        vf wt[TILE_HEADS];
        for (int r = 0; r < NH; r++) wt[r] = vf_set1(w[r * S + t]);
        for (int c = 0; c < N; c++) {
            const vf vv = vf_load_row(vb + t * hd * elt, c0 + c * VW, bf16);
            for (int r = 0; r < NH; r++) a[r][c] = vf_fma(wt[r], vv, a[r][c]);
        }
    }
    for (int r = 0; r < NH; r++)
        for (int c = 0; c < N; c++) vf_store(acc + r * hd + c0 + c * VW, a[r][c]);
}

static void scores_heads(const float *qf, const char *kp, long hd, long elt, int bf16, float *s, long S, long nh) {
    switch (nh) {
    case 1: scores_tile(qf, kp, hd, elt, bf16, s, S, 1); break;
    case 2: scores_tile(qf, kp, hd, elt, bf16, s, S, 2); break;
    default: scores_tile(qf, kp, hd, elt, bf16, s, S, TILE_HEADS); break;
    }
}

static void weigh_heads(float *acc, const float *w, long S, const char *vb, long n, long hd, long elt, int bf16,
                        long nh) {
    for (long c0 = 0; c0 < hd; c0 += TILE_VECTORS * VW) {
        const long left = (hd - c0) / VW;
#define WEIGH(NH) \
        if (left >= TILE_VECTORS) weigh_tile(acc, w, S, vb, n, hd, elt, bf16, c0, NH, TILE_VECTORS); \
        else if (left == 3) weigh_tile(acc, w, S, vb, n, hd, elt, bf16, c0, NH, 3); \
        else if (left == 2) weigh_tile(acc, w, S, vb, n, hd, elt, bf16, c0, NH, 2); \
        else weigh_tile(acc, w, S, vb, n, hd, elt, bf16, c0, NH, 1);
        switch (nh) {
        case 1: WEIGH(1) break;
        case 2: WEIGH(2) break;
        default: WEIGH(TILE_HEADS) break;
        }
#undef WEIGH
    }
}

/* softmax over positions 0..T-1 of each of the R score rows s[r * S ..] (S a multiple of 8), in place */
static void softmax_rows(float *s, long R, long T, long S) {
    for (long r = 0; r < R; r++) {
        float *sr = s + r * S;
        for (long t = T; t < S; t++) sr[t] = -INFINITY;
        __m256 mv = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
        for (long t = 0; t < S; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + t));
        const __m256 mx = _mm256_set1_ps(hmax(mv));
        for (long t = 0; t < S; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + t), mx));
            _mm256_storeu_ps(sr + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        const __m256 inv = _mm256_set1_ps(1.f / hsum(sum));
        for (long t = 0; t < S; t += 8) _mm256_storeu_ps(sr + t, _mm256_mul_ps(_mm256_loadu_ps(sr + t), inv));
    }
}

/* A row's blocks lie anywhere in the pool: the hardware prefetcher, following addresses, does not know
 * the next one. Asked for while this block is read, it is in cache when its turn comes. */
static inline void prefetch_block(const char *p, long bytes) {
    for (long i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

/* The scores of the R heads at qf against one block's K rows kb: s[r * S + p], p < BLOCK. The group's heads
 * TILE_HEADS at a time where hd is a multiple of VW, else one head at a time in 8-float vectors. */
static void block_scores(const float *qf, const char *kb, long R, long hd, long elt, int bf16, float *s, long S) {
    if (hd % VW == 0) {
        for (long r0 = 0; r0 < R; r0 += TILE_HEADS)
            for (int p0 = 0; p0 < BLOCK; p0 += TILE_POSITIONS)
                scores_heads(qf + r0 * hd, kb + p0 * hd * elt, hd, elt, bf16, s + r0 * S + p0, S,
                             R - r0 < TILE_HEADS ? R - r0 : TILE_HEADS);
        return;
    }
    for (long r = 0; r < R; r++)
        for (int p0 = 0; p0 < BLOCK; p0 += 8)
            _mm256_storeu_ps(s + r * S + p0, scores8(qf + r * hd, kb + p0 * hd * elt, hd, elt, bf16));
}

/* acc[r * hd ..] += Σ_t w[r * S + t] · V row t of block vb, t < n, for the R heads (as block_scores groups them) */
static void block_weigh(float *acc, const float *w, long S, const char *vb, long n, long R, long hd, long elt,
                        int bf16) {
    if (hd % VW == 0) {
        for (long r0 = 0; r0 < R; r0 += TILE_HEADS)
            weigh_heads(acc + r0 * hd, w + r0 * S, S, vb, n, hd, elt, bf16, R - r0 < TILE_HEADS ? R - r0 : TILE_HEADS);
        return;
    }
    for (long r = 0; r < R; r++) {
        if (hd % 64 == 0) weigh(acc + r * hd, w + r * S, vb, n, hd, elt, bf16, 8);
        else weigh(acc + r * hd, w + r * S, vb, n, hd, elt, bf16, 1);
    }
}

/* One (row b, kv head g): the R = H / G query heads of g's group over positions 0..T-1. Scores are taken
 * for whole blocks (a block's unused positions are allocated, their scores ignored). */
static void one_task(const void *q, const char *k, const char *v, const int64_t *table, long T, void *out,
                     long b, long g, long H, long R, long hd, long nblocks, float scale, int bf16, float *buf) {
    const long elt = bf16 ? 2 : 4, S = (T + BLOCK - 1) / BLOCK * BLOCK, blocks = S / BLOCK;
    float *qf = buf, *acc = buf + R * hd, *s = buf + 2 * R * hd; /* [R, hd], [R, hd], [R, S] */
    const __m256 sc = _mm256_set1_ps(scale);
    for (long r = 0; r < R; r++)
        for (long i = 0; i < hd; i += 8)
            _mm256_storeu_ps(qf + r * hd + i, _mm256_mul_ps(sc, load8(q, (b * H + g * R + r) * hd + i, bf16)));
    const long head = g * nblocks, bytes = BLOCK * hd * elt;
    for (long j = 0; j < blocks; j++) {
        if (j + 1 < blocks) prefetch_block(k + (head + table[j + 1]) * bytes, bytes);
        block_scores(qf, k + (head + table[j]) * bytes, R, hd, elt, bf16, s + j * BLOCK, S);
    }
    softmax_rows(s, R, T, S);
    memset(acc, 0, sizeof(float) * R * hd);
    for (long j = 0; j < blocks; j++) {
        if (j + 1 < blocks) prefetch_block(v + (head + table[j + 1]) * bytes, bytes);
        const long n = T - j * BLOCK < BLOCK ? T - j * BLOCK : BLOCK;
        block_weigh(acc, s + j * BLOCK, S, v + (head + table[j]) * bytes, n, R, hd, elt, bf16);
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
