/* RMSNorm for the eager decode step: one call instead of four torch ops.
 *
 * Built into the same library as gemv.c (generator/kernels/build.py). At one row each torch op costs its
 * dispatch and allocation, not its arithmetic: torch's CPU rms_norm takes 15-25 us for one row of
 * 576 (~41 us with the cast and multiply around it), 61 times a step: ~2.5 ms of a ~16 ms eager
 * one-row step on a 2-core AMX Xeon. Math in fp32, rounded
 * where the torch code it replaces rounds (bf16 in and out), 8 floats a vector. RoPE and SiLU * up
 * are pointwise.c's (written element by element at first, they lost to torch's vectorized ops).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rows.h"

static void one_row(const void *x, const void *w, void *y, long dim, float eps, int bf16) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = load8(x, i, bf16);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < dim; i++) ss += get(x, i, bf16) * get(x, i, bf16);
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    if (!bf16) {
        float *yf = y;
        for (i = 0; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(yf + i, _mm256_mul_ps(_mm256_mul_ps(load8(x, i, 0), iv), load8(w, i, 0)));
        for (; i < dim; i++) yf[i] = ((const float *)x)[i] * inv * ((const float *)w)[i];
        return;
    }
    uint16_t *yb = y;
    for (i = 0; i + 8 <= dim; i += 8) {
        const __m256 n = round_to_bf16(_mm256_mul_ps(load8(x, i, 1), iv)); /* the normalised row, rounded */
        store8(yb, i, _mm256_mul_ps(n, load8(w, i, 1)), 1);
    }
    for (; i < dim; i++) {
        const uint16_t n = round_bf16(get(x, i, 1) * inv);
        const uint32_t nu = (uint32_t)n << 16;
        float nf;
        memcpy(&nf, &nu, 4);
        yb[i] = round_bf16(nf * get(w, i, 1));
    }
}

/* RMSNorm, y = w * (x / sqrt(mean(x^2) + eps)). x, y [rows, dim], w [dim]: all fp32, or all bf16 with
 * ``bf16``: then the normalised row is rounded to bf16 before the weight multiplies it (a bf16 x bf16
 * product, rounded again), as forward._rms_norm's torch path does. */
void tp_rms_norm(const void *x, const void *w, void *y, long rows, long dim, float eps, int threads, int bf16) {
    const long elt = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= PARALLEL_ELEMENTS)
    for (long r = 0; r < rows; r++)
        one_row((const char *)x + r * dim * elt, w, (char *)y + r * dim * elt, dim, eps, bf16);
}
