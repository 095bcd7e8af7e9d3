// gemv.c's kernels as the torch ops tokenpipe::gemv_q4 and tokenpipe::gemv_q8, gemm8.c's as tokenpipe::gemm8,
// attention.c's as tokenpipe::paged_attention and kv_write, norm.c's as tokenpipe::rms_norm, pointwise.c's as
// rope_write and silu_mul: called through torch's dispatcher from C++, an op costs ~35 us less per call than a
// Python-defined one, which at 121 projections a step is most of what the kernel saves.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <new>
#include <vector>

#include "checks.h"
#include "library.h"

namespace {

// x as the kernel reads it: bf16 or fp32 as given (no copy when contiguous), anything else as fp32
at::Tensor rows_of(const at::Tensor &x2, int64_t k) {
    TORCH_CHECK(x2.dim() == 2 && x2.size(1) == k, "gemv: x must be [M, ", k, "], got ", x2.sizes());
    TORCH_CHECK(k % 32 == 0, "gemv: K must be a multiple of 32, got ", k);
    const bool native = x2.scalar_type() == at::kBFloat16 || x2.scalar_type() == at::kFloat;
    return (native ? x2 : x2.to(at::kFloat)).contiguous();
}

// y in x's dtype (bf16 or fp32), written by the kernel itself; other dtypes get fp32 converted back
at::Tensor finish(const at::Tensor &y, const at::Tensor &x2) {
    return y.scalar_type() == x2.scalar_type() ? y : y.to(x2.scalar_type());
}

at::Tensor gemv_q4(const at::Tensor &x2, const at::Tensor &nibbles, const at::Tensor &d, const at::Tensor &m) {
    at::Tensor x = rows_of(x2, nibbles.size(1) * 2);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    at::Tensor y = at::empty({x.size(0), nibbles.size(0)}, x.options());
    if (tp_gemv_q4(nibbles.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), x.data_ptr(), y.data_ptr(),
                   x.size(0), x.size(1), nibbles.size(0), at::get_num_threads(), bf16))
        throw std::bad_alloc();
    return finish(y, x2);
}

at::Tensor gemv_q8(const at::Tensor &x2, const at::Tensor &q, const at::Tensor &s) {
    at::Tensor x = rows_of(x2, q.size(1));
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options());
    if (tp_gemv_q8(q.data_ptr<int8_t>(), s.data_ptr<float>(), x.data_ptr(), y.data_ptr(), x.size(0), x.size(1),
                   q.size(0), at::get_num_threads(), bf16))
        throw std::bad_alloc();
    return finish(y, x2);
}

// w [blocks, G * LANES * bits * 4] uint8, d, m [blocks, G, LANES] (gemm8.c's layout) -> [M, n]
at::Tensor gemm8(const at::Tensor &x2, const at::Tensor &w, const at::Tensor &d, const at::Tensor &m, int64_t bits,
                 int64_t n, bool tiles) {
    tokenpipe::check_blocked("gemm8", w, d, m, bits, n);
    at::Tensor x = rows_of(x2, d.size(1) * 32);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    if (tp_gemm8(w.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), static_cast<int>(bits), x.data_ptr(),
                 y.data_ptr(), x.size(0), x.size(1), n, at::get_num_threads(), bf16, tiles))
        throw std::bad_alloc();
    return finish(y, x2);
}

// nibbles [N, K/2], d, m [N, K/32] -> the weight [N, K] in bf16 (``bf16``) or fp32
at::Tensor dequant_q4(const at::Tensor &nibbles, const at::Tensor &d, const at::Tensor &m, bool bf16) {
    const int64_t N = nibbles.size(0), K = nibbles.size(1) * 2;
    TORCH_CHECK(nibbles.is_contiguous() && d.is_contiguous() && m.is_contiguous() && d.size(0) == N &&
                d.size(1) * 32 == K && m.sizes() == d.sizes(), "dequant_q4: nibbles [N, K/2], d, m [N, K/32] expected");
    at::Tensor y = at::empty({N, K}, nibbles.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
    tp_dequant_q4(nibbles.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), y.data_ptr(), K, N,
                  at::get_num_threads(), bf16);
    return y;
}

// q [N, K] int8, s [N] -> the weight [N, K] in bf16 (``bf16``) or fp32
at::Tensor dequant_q8(const at::Tensor &q, const at::Tensor &s, bool bf16) {
    const int64_t N = q.size(0), K = q.size(1);
    TORCH_CHECK(q.is_contiguous() && s.is_contiguous() && s.numel() == N && K % 8 == 0,
                "dequant_q8: q [N, K] (K a multiple of 8) and s [N] expected");
    at::Tensor y = at::empty({N, K}, q.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
    tp_dequant_q8(q.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr(), K, N, at::get_num_threads(), bf16);
    return y;
}

int64_t gemm8_lanes() { return tp_gemm8_lanes(); }

bool gemm8_tiles() { return tp_gemm8_tiles() != 0; }

// q [B, H, hd]; k, v one layer's pool [G, num_blocks, 16, hd]; tables [B, width]; positions [B] -> [B, H, hd]
at::Tensor paged_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &tables,
                           const at::Tensor &positions, double scale) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes(), "paged_attention: q [B, H, hd] and k, v "
                "[G, blocks, 16, hd] expected, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
    const int64_t B = q.size(0), H = q.size(1), hd = q.size(2), G = k.size(0), width = tables.size(1);
    TORCH_CHECK(k.size(2) == 16 && k.size(3) == hd && hd % 8 == 0 && H % G == 0, "paged_attention: shapes ",
                q.sizes(), " and ", k.sizes(), " do not fit (hd a multiple of 8, H of G)");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
                "paged_attention: q, k, v must share one dtype, fp32 or bf16");
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "paged_attention: the pool must be contiguous");
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && positions.numel() == B, "paged_attention: tables [B, "
                "width] and positions [B] expected, got ", tables.sizes(), ", ", positions.sizes());
    at::Tensor qc = q.contiguous(), tab = tables.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
    const int64_t *p = pos.data_ptr<int64_t>(), *t = tab.data_ptr<int64_t>();
    tokenpipe::check_attended("paged_attention", p, t, B, width, k.size(1));
    at::Tensor out = at::empty({B, H, hd}, q.options());
    if (tp_paged_attention(qc.data_ptr(), k.data_ptr(), v.data_ptr(), t, p, out.data_ptr(), B, H, G, hd, k.size(1),
                           width, static_cast<float>(scale), at::get_num_threads(),
                           q.scalar_type() == at::kBFloat16))
        throw std::bad_alloc();
    return out;
}

// x [..., dim], w [dim] -> x's shape
at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &w, double eps) {
    TORCH_CHECK(w.dim() == 1 && x.dim() >= 1 && x.size(-1) == w.size(0), "rms_norm: x [..., ", w.size(0),
                "] expected, got ", x.sizes());
    TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kBFloat16 ||
                x.scalar_type() == at::kFloat), "rms_norm: x and w must share one dtype, fp32 or bf16");
    at::Tensor xc = x.contiguous(), wc = w.contiguous();
    at::Tensor y = at::empty(x.sizes(), x.options());
    const int64_t dim = w.size(0);
    tp_rms_norm(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), dim ? xc.numel() / dim : 0, dim,
                static_cast<float>(eps), at::get_num_threads(), x.scalar_type() == at::kBFloat16);
    return y;
}

// this step's k, v [B, G, hd] into one layer's pool kv [2, G, blocks, 16, hd] at the flat positions slots [B]
void kv_write(const at::Tensor &kv, const at::Tensor &k, const at::Tensor &v, const at::Tensor &slots) {
    TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous() && k.dim() == 3 && k.sizes() == v.sizes() &&
                k.size(1) == kv.size(1) && k.size(2) == kv.size(4) && k.stride(2) == 1 && v.stride(2) == 1,
                "kv_write: kv [2, G, blocks, 16, hd] (contiguous), k, v [B, G, hd] expected, got ", kv.sizes(), ", ",
                k.sizes());
    TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(),
                "kv_write: k, v and the pool must share one dtype");
    at::Tensor sl = slots.to(at::kLong).contiguous();
    const int64_t positions = kv.size(2) * kv.size(3), *p = sl.data_ptr<int64_t>();
    TORCH_CHECK(sl.numel() == k.size(0), "kv_write: one slot per row expected");
    tokenpipe::check_slots("kv_write", p, sl.numel(), positions);
    tp_kv_write(static_cast<char *>(kv.data_ptr()), static_cast<const char *>(k.data_ptr()),
                static_cast<const char *>(v.data_ptr()), k.stride(0), k.stride(1), v.stride(0), v.stride(1), p,
                k.size(0), k.size(1), positions, k.size(2), kv.element_size());
}

// qkv [B, (H + 2G) * hd] -> q [B, H, hd] rotated; k rotated and v into one layer's pool kv [2, G, blocks, 16, hd]
// at the flat positions slots [B]; cos, ssin [B, hd] (forward._rotary's, squeezed)
at::Tensor rope_write(const at::Tensor &qkv, const at::Tensor &cos, const at::Tensor &ssin, const at::Tensor &kv,
                      const at::Tensor &slots, int64_t heads) {
    TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous() && qkv.dim() == 2, "rope_write: kv [2, G, "
                "blocks, 16, hd] (contiguous) and qkv [B, (H + 2G) * hd] expected, got ", kv.sizes(), ", ",
                qkv.sizes());
    const int64_t B = qkv.size(0), G = kv.size(1), hd = kv.size(4), positions = kv.size(2) * kv.size(3);
    TORCH_CHECK(hd % 16 == 0 && qkv.size(1) == (heads + 2 * G) * hd && cos.sizes() == ssin.sizes() &&
                cos.dim() == 2 && cos.size(0) == B && cos.size(1) == hd, "rope_write: shapes do not fit: qkv ",
                qkv.sizes(), ", cos ", cos.sizes(), ", ", heads, " heads of ", hd, " (a multiple of 16)");
    TORCH_CHECK(qkv.scalar_type() == kv.scalar_type() && cos.scalar_type() == kv.scalar_type() &&
                ssin.scalar_type() == kv.scalar_type() && (kv.scalar_type() == at::kBFloat16 ||
                kv.scalar_type() == at::kFloat), "rope_write: one dtype, fp32 or bf16");
    at::Tensor sl = slots.to(at::kLong).contiguous(), x = qkv.contiguous(), c = cos.contiguous(), s = ssin.contiguous();
    TORCH_CHECK(sl.numel() == B, "rope_write: one slot per row expected");
    const int64_t *p = sl.data_ptr<int64_t>();
    tokenpipe::check_slots("rope_write", p, B, positions);
    at::Tensor q = at::empty({B, heads, hd}, qkv.options());
    tp_rope_write(x.data_ptr(), c.data_ptr(), s.data_ptr(), q.data_ptr(), static_cast<char *>(kv.data_ptr()), p, B,
                  heads, G, hd, positions, kv.scalar_type() == at::kBFloat16);
    return q;
}

// gu [..., 2 * inter] (gate, up) -> silu(gate) * up [..., inter]
at::Tensor silu_mul(const at::Tensor &gu) {
    TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 16 == 0 && (gu.scalar_type() == at::kBFloat16 ||
                gu.scalar_type() == at::kFloat), "silu_mul: [..., 2 * inter] fp32 or bf16 with inter a multiple of "
                "8 expected, got ", gu.sizes(), " ", gu.scalar_type());
    at::Tensor x = gu.contiguous();
    std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
    const int64_t inter = shape.back() / 2;
    shape.back() = inter;
    at::Tensor y = at::empty(shape, gu.options());
    tp_silu_mul(x.data_ptr(), y.data_ptr(), inter ? x.numel() / (2 * inter) : 0, inter, at::get_num_threads(),
                gu.scalar_type() == at::kBFloat16);
    return y;
}

// shapes only, for torch.compile's tracing
at::Tensor gemv_q4_meta(const at::Tensor &x2, const at::Tensor &nibbles, const at::Tensor &, const at::Tensor &) {
    return at::empty({x2.size(0), nibbles.size(0)}, x2.options());
}

at::Tensor gemv_q8_meta(const at::Tensor &x2, const at::Tensor &q, const at::Tensor &) {
    return at::empty({x2.size(0), q.size(0)}, x2.options());
}

at::Tensor gemm8_meta(const at::Tensor &x2, const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t,
                      int64_t n, bool) {
    return at::empty({x2.size(0), n}, x2.options());
}

at::Tensor paged_attention_meta(const at::Tensor &q, const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                const at::Tensor &, double) {
    return at::empty(q.sizes(), q.options());
}

at::Tensor rms_norm_meta(const at::Tensor &x, const at::Tensor &, double) {
    return at::empty(x.sizes(), x.options());
}

at::Tensor rope_write_meta(const at::Tensor &qkv, const at::Tensor &, const at::Tensor &, const at::Tensor &kv,
                           const at::Tensor &, int64_t heads) {
    return at::empty({qkv.size(0), heads, kv.size(4)}, qkv.options());
}

at::Tensor silu_mul_meta(const at::Tensor &gu) {
    std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
    shape.back() /= 2;
    return at::empty(shape, gu.options());
}

void kv_write_meta(const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &) {}

}  // namespace

TORCH_LIBRARY(tokenpipe, lib) {
    lib.def("gemv_q4(Tensor x, Tensor nibbles, Tensor d, Tensor m) -> Tensor");
    lib.def("gemv_q8(Tensor x, Tensor q, Tensor s) -> Tensor");
    lib.def("gemm8(Tensor x, Tensor w, Tensor d, Tensor m, int bits, int n, bool tiles=False) -> Tensor");
    lib.def("dequant_q4(Tensor nibbles, Tensor d, Tensor m, bool bf16) -> Tensor");
    lib.def("dequant_q8(Tensor q, Tensor s, bool bf16) -> Tensor");
    lib.def("gemm8_tiles() -> bool", &gemm8_tiles);  // AMX built here and granted by the kernel
    lib.def("gemm8_lanes() -> int", &gemm8_lanes);  // no tensor to dispatch on: one kernel for every key
    lib.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor tables, Tensor positions, float scale) -> Tensor");
    lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
    lib.def("kv_write(Tensor(a!) kv, Tensor k, Tensor v, Tensor slots) -> ()");
    lib.def("rope_write(Tensor qkv, Tensor cos, Tensor ssin, Tensor(a!) kv, Tensor slots, int heads) -> Tensor");
    lib.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenpipe, CPU, lib) {
    lib.impl("gemv_q4", &gemv_q4);
    lib.impl("gemv_q8", &gemv_q8);
    lib.impl("gemm8", &gemm8);
    lib.impl("dequant_q4", &dequant_q4);
    lib.impl("dequant_q8", &dequant_q8);
    lib.impl("paged_attention", &paged_attention);
    lib.impl("rms_norm", &rms_norm);
    lib.impl("kv_write", &kv_write);
    lib.impl("rope_write", &rope_write);
    lib.impl("silu_mul", &silu_mul);
}

TORCH_LIBRARY_IMPL(tokenpipe, Meta, lib) {
    lib.impl("gemv_q4", &gemv_q4_meta);
    lib.impl("gemv_q8", &gemv_q8_meta);
    lib.impl("gemm8", &gemm8_meta);
    lib.impl("paged_attention", &paged_attention_meta);
    lib.impl("rms_norm", &rms_norm_meta);
    lib.impl("kv_write", &kv_write_meta);
    lib.impl("rope_write", &rope_write_meta);
    lib.impl("silu_mul", &silu_mul_meta);
}
