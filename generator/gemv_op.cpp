// generator/gemv.c's kernels as the torch ops tokenpipe::gemv_q4 and tokenpipe::gemv_q8: called
// through torch's dispatcher from C++, an op costs ~35 us less per call than a Python-defined
// one, which at 121 projections a step is most of what the kernel saves (issue 21, part 4).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <new>

extern "C" {
int tp_gemv_q4(const uint8_t *w, const float *d, const float *m, const void *x, void *y, long M, long K, long N,
               int threads, int bf16);
int tp_gemv_q8(const int8_t *w, const float *s, const void *x, void *y, long M, long K, long N, int threads, int bf16);
}

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

// shapes only, for torch.compile's tracing
at::Tensor gemv_q4_meta(const at::Tensor &x2, const at::Tensor &nibbles, const at::Tensor &, const at::Tensor &) {
    return at::empty({x2.size(0), nibbles.size(0)}, x2.options());
}

at::Tensor gemv_q8_meta(const at::Tensor &x2, const at::Tensor &q, const at::Tensor &) {
    return at::empty({x2.size(0), q.size(0)}, x2.options());
}

}  // namespace

TORCH_LIBRARY(tokenpipe, lib) {
    lib.def("gemv_q4(Tensor x, Tensor nibbles, Tensor d, Tensor m) -> Tensor");
    lib.def("gemv_q8(Tensor x, Tensor q, Tensor s) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenpipe, CPU, lib) {
    lib.impl("gemv_q4", &gemv_q4);
    lib.impl("gemv_q8", &gemv_q8);
}

TORCH_LIBRARY_IMPL(tokenpipe, Meta, lib) {
    lib.impl("gemv_q4", &gemv_q4_meta);
    lib.impl("gemv_q8", &gemv_q8_meta);
}
