/* fp32 and bf16 rows as the library's kernels read and write them (gemv.c, gemm8.c, attention.c, norm.c, pointwise.c):
 * with ``bf16`` a row is bfloat16, read widened to fp32 and written rounded to nearest even, as
 * torch rounds; otherwise fp32. Taking a bf16 model's activations as they are saves an op two
 * conversions and two tensors a call. */
#ifndef TOKENPIPE_ROWS_H
#define TOKENPIPE_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* elements below which an element-wise op (norm.c, pointwise.c) runs on one thread: waking the team costs more */
#define PARALLEL_ELEMENTS (1L << 16)

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

/* the largest of v's 8 lanes */
static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* e^x, 8 lanes (Cephes' polynomial, as avx_mathfun): ~1e-7 relative, x clamped to [-87, 88].
 * libm's expf one value at a time was the largest part of the attention kernel's time. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
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

/* round_bf16 of 8 lanes, as 8 bf16 values */
static inline __m128i round_bf16_8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    /* packus works per 128-bit lane: the permute brings lane 1's four values next to lane 0's */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* v rounded to bf16 and kept as fp32: where the torch code rounds between two ops */
static inline __m256 round_to_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(round_bf16_8(v)), 16));
}

/* elements i..i+7 of a row set to v's lanes (rounded to bf16 with ``bf16``) */
static inline void store8(void *y, long i, __m256 v, int bf16) {
    if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)y + i), round_bf16_8(v));
    else _mm256_storeu_ps((float *)y + i, v);
}

#endif
