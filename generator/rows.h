/* fp32 and bf16 rows as the library's kernels read and write them (gemv.c, attention.c, norm.c):
 * with ``bf16`` a row is bfloat16, read widened to fp32 and written rounded to nearest even, as
 * torch rounds; otherwise fp32. Taking a bf16 model's activations as they are saves an op two
 * conversions and two tensors a call (bench/RESULTS.md, "issue 21, part 10"). */
#ifndef TOKENPIPE_ROWS_H
#define TOKENPIPE_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* v's bf16 bits, rounded to nearest even */
static inline uint16_t round_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* element i of a row, as a float */
static inline float get(const void *p, long i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* elements i..i+7 of a row, as floats */
static inline __m256 load8(const void *p, long i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* element i of a row set to v */
static inline void put(void *y, long i, float v, int bf16) {
    if (bf16) ((uint16_t *)y)[i] = round_bf16(v);
    else ((float *)y)[i] = v;
}

/* the sum of v's 8 lanes */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
