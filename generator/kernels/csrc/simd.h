/* The vector width's one abstraction: a float vector ``vf`` and an integer vector ``vi`` of SIMD_BITS (256 or
 * 512), and the loads, stores, multiply-adds and reductions the kernels need on them, as inline functions.
 * gemv.c's one-row loops, gemm8.c's blocks and attention.c's tiles are written once against these and
 * compiled once per width: each x86 level of the library (generator/kernels/levels.py) compiles every file
 * once, and the level's flags pick the width here.
 *
 * SIMD_BITS is 512 where the compiler targets AVX-512F and BW, else 256 (AVX2 + FMA). A file may ask for
 * 256 before including this header (gemm8.c without VNNI: its byte products are AVX2's there, at any
 * width). Each function does what the file's own 256- or 512-bit code did before, instruction for
 * instruction, so results are bit for bit those of the hand-written versions.
 *
 * The 8-float helpers every width shares (bf16 rows, hsum, exp8) are rows.h's.
 */
#ifndef TOKENPIPE_SIMD_H
#define TOKENPIPE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#ifndef SIMD_BITS
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SIMD_BITS 512
#else
#define SIMD_BITS 256
#endif
#endif

#if SIMD_BITS == 512
#define VF_LANES 16 /* floats (and int32) per vector; int16 lanes are twice as many, bytes four times */
#define VF_MASKED 1 /* vf_load_first and vi_load_first_bytes are one masked load (any n) */
typedef __m512 vf;
typedef __m512i vi;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_from_i32(vi v) { return _mm512_cvtepi32_ps(v); }
/* lanes 0..n-1 of p (n may exceed VF_LANES), zeros above: nothing past them is read */
static inline vf vf_load_first(const float *p, long n) {
    return _mm512_maskz_loadu_ps(n >= VF_LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), p);
}
/* p[h] on lanes 4h..4h+3 for h < groups (<= VF_LANES / 4), zeros above: a block's group scales over its sums */
static inline vf vf_spread4(const float *p, long groups) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps((__mmask16)((1u << groups) - 1), p));
}
/* elements i.. of an fp32 row, or of a bf16 one (``bf16``) widened */
static inline vf vf_load_row(const void *p, long i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* the two halves' sum, 8 lanes */
static inline __m256 vf_halves(vf a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
/* bytes 0..n-1 of p, zeros above */
static inline vi vi_load_first_bytes(const void *p, long n) {
    return _mm512_maskz_loadu_epi8(n >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << n) - 1, p);
}
/* VF_LANES * 2 int8 at p widened to int16 */
static inline vi vi_widen_i8(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_srl16(vi a, int n) { return _mm512_srli_epi16(a, (unsigned)n); }
static inline vi vi_set1_8(char x) { return _mm512_set1_epi8(x); }
static inline vi vi_set1_16(short x) { return _mm512_set1_epi16(x); }
static inline vi vi_set1_32(int x) { return _mm512_set1_epi32(x); }
static inline vi vi_add32(vi a, vi b) { return _mm512_add_epi32(a, b); }
/* int16 pairs multiplied and summed into int32 lanes */
static inline vi vi_madd16(vi a, vi b) { return _mm512_madd_epi16(a, b); }
/* acc + vi_madd16(a, b): one VNNI instruction where built with it (exact either way) */
static inline vi vi_dpwssd(vi acc, vi a, vi b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
/* acc + the sums of four u8 * s8 products per int32 lane: VNNI's, or pairs summed in int16 first
 * (saturating: the caller keeps |s8| small enough) */
static inline vi vi_dpbusd(vi acc, vi u8, vi s8) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u8, s8);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
#endif
}

#elif SIMD_BITS == 256
#define VF_LANES 8
#define VF_MASKED 0 /* they test n (vi_load_first_bytes: 16 or 32 bytes only) */
typedef __m256 vf;
typedef __m256i vi;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_from_i32(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vf vf_load_first(const float *p, long n) {
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(p, k);
}
static inline vf vf_spread4(const float *p, long groups) {
    return _mm256_blend_ps(_mm256_broadcast_ss(p), groups == 2 ? _mm256_broadcast_ss(p + 1) : _mm256_setzero_ps(), 0xF0);
}
static inline vf vf_load_row(const void *p, long i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 vf_halves(vf a) { return a; }

static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* n is 16 or 32 where used (one or two groups of 4-bit weights) */
static inline vi vi_load_first_bytes(const void *p, long n) {
    return n >= 32 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
}
static inline vi vi_widen_i8(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_srl16(vi a, int n) { return _mm256_srli_epi16(a, n); }
static inline vi vi_set1_8(char x) { return _mm256_set1_epi8(x); }
static inline vi vi_set1_16(short x) { return _mm256_set1_epi16(x); }
static inline vi vi_set1_32(int x) { return _mm256_set1_epi32(x); }
static inline vi vi_add32(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_madd16(vi a, vi b) { return _mm256_madd_epi16(a, b); }
static inline vi vi_dpwssd(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
static inline vi vi_dpbusd(vi acc, vi u8, vi s8) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}

#else
#error "SIMD_BITS must be 256 or 512"
#endif

/* the lane sums of a[0..4), as 4 floats */
static inline __m128 vf_sums4(const vf *a) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(vf_halves(a[0]), vf_halves(a[1])),
                                    _mm256_hadd_ps(vf_halves(a[2]), vf_halves(a[3])));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#endif
