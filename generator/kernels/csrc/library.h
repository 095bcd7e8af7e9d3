// The C entry points of the library generator/kernels/build.py builds (gemv.c, gemm8.c, attention.c, norm.c,
// pointwise.c), as the C++ op bindings call them (gemv_op.cpp, stack_op.cpp). Row pointers are bf16 with
// ``bf16``, else fp32; ``threads`` is the engine's team (at::get_num_threads()). A nonzero int return
// means a scratch allocation failed.
#ifndef TOKENPIPE_LIBRARY_H
#define TOKENPIPE_LIBRARY_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
int tp_gemv_q4(const uint8_t *w, const float *d, const float *m, const void *x, void *y, long M, long K, long N,
               int threads, int bf16);
int tp_gemv_q8(const int8_t *w, const float *s, const void *x, void *y, long M, long K, long N, int threads, int bf16);
int tp_gemm8(const uint8_t *w, const float *d, const float *m, int bits, const void *x, void *y, long M, long K,
             long N, int threads, int bf16, int tiles);
int tp_dequant_q4(const uint8_t *w, const float *d, const float *m, void *y, long K, long N, int threads, int bf16);
int tp_dequant_q8(const int8_t *w, const float *s, void *y, long K, long N, int threads, int bf16);
int tp_gemm8_lanes(void);
int tp_gemm8_tiles(void);
int tp_paged_attention(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *positions,
                       void *out, long B, long H, long G, long hd, long nblocks, long width, float scale, int threads,
                       int bf16);
void tp_rms_norm(const void *x, const void *w, void *y, long rows, long dim, float eps, int threads, int bf16);
void tp_rope_write(const void *qkv, const void *cos, const void *ssin, void *q, char *kv, const int64_t *slots,
                   long B, long H, long G, long hd, long positions, int bf16);
void tp_silu_mul(const void *gu, void *y, long rows, long inter, int threads, int bf16);
void tp_add_rows(void *x, const void *a, long n, int bf16);
void tp_kv_write(char *kv, const char *k, const char *v, long kb, long kg, long vb, long vg, const int64_t *slots,
                 long B, long G, long positions, long hd, long elt);
#ifdef __cplusplus
}
#endif

#endif
