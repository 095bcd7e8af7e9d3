/* The eager decode step's element-wise ops, one call each where torch takes several.
 *
 * Built into the same library as gemv.c (generator/kernels/build.py). At one row a torch op costs its
 * dispatch, its output's allocation and the views around it, not its arithmetic: RoPE on q and k
 * (view, roll, multiply, addcmul, the transposes) and the cache write took ~45 us a layer, SiLU(gate)
 * * up with its split ~20 us, on a 2-core AMX Xeon. Math in
 * fp32, 8 floats a vector, rounded where the torch code rounds (bf16 in and out).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "rows.h"

/* x[0..hd) rotated into y: x * cos + roll(x, hd / 2) * ssin (forward._rope), rounded after each as its
 * torch ops round; hd a multiple of 16, so a vector of the rolled half never wraps */
static inline void rotate(const void *x, const void *cos, const void *ssin, void *y, long hd, int bf16) {
    const long half = hd / 2;
    for (long i = 0; i < hd; i += 8) {
        __m256 a = _mm256_mul_ps(load8(x, i, bf16), load8(cos, i, bf16));
        if (bf16) a = round_to_bf16(a);
        store8(y, i, _mm256_fmadd_ps(load8(x, (i + half) % hd, bf16), load8(ssin, i, bf16), a), bf16);
    }
}

/* One decode step's q, k, v from the fused projection qkv [B, (H + 2G) * hd]: q rotated into q [B, H, hd],
 * k rotated and v copied into one layer's pool kv [2, G, positions, hd] at the flat positions slots[b]. cos
 * and ssin [B, hd] (ssin's first half negated: forward._rotary). */
void tp_rope_write(const void *qkv, const void *cos, const void *ssin, void *q, char *kv, const int64_t *slots,
                   long B, long H, long G, long hd, long positions, int bf16) {
    const long elt = bf16 ? 2 : 4, width = (H + 2 * G) * hd;
    for (long b = 0; b < B; b++) {
        const char *row = (const char *)qkv + b * width * elt;
        const char *c = (const char *)cos + b * hd * elt, *s = (const char *)ssin + b * hd * elt;
        for (long h = 0; h < H; h++) rotate(row + h * hd * elt, c, s, (char *)q + (b * H + h) * hd * elt, hd, bf16);
        for (long g = 0; g < G; g++) {
            rotate(row + (H + g) * hd * elt, c, s, kv + (g * positions + slots[b]) * hd * elt, hd, bf16);
            memcpy(kv + ((G + g) * positions + slots[b]) * hd * elt, row + (H + G + g) * hd * elt, hd * elt);
        }
    }
}

/* y [rows, inter] = silu(gate) * up from gu [rows, 2 * inter] (gate, then up): silu rounded, then the product,
 * as act_fn(gate) * up rounds; inter a multiple of 8 */
void tp_silu_mul(const void *gu, void *y, long rows, long inter, int threads, int bf16) {
    const long elt = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * inter >= PARALLEL_ELEMENTS)
    for (long r = 0; r < rows; r++) {
        const char *g = (const char *)gu + r * 2 * inter * elt, *u = g + inter * elt;
        char *out = (char *)y + r * inter * elt;
        for (long i = 0; i < inter; i += 8) {
            const __m256 gv = load8(g, i, bf16);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
            if (bf16) sv = round_to_bf16(sv);
            store8(out, i, _mm256_mul_ps(sv, load8(u, i, bf16)), bf16);
        }
    }
}

/* x[0..n) += a[0..n), rounded as torch's x + a rounds (the residual adds of stack_op.cpp's step); one thread:
 * a step's residual is at most a few ten thousand elements */
void tp_add_rows(void *x, const void *a, long n, int bf16) {
    long i = 0;
    for (; i + 8 <= n; i += 8) store8(x, i, _mm256_add_ps(load8(x, i, bf16), load8(a, i, bf16)), bf16);
    for (; i < n; i++) put(x, i, get(x, i, bf16) + get(a, i, bf16), bf16);
}
