// tokenpipe.DecodeStack: the eager decode step's decoder layers in one call from Python.
//
// Each op of a layer (RMSNorm, the four projections, RoPE with the cache write, attention over the pool,
// SiLU * up, the residual adds) is one call of the library's C code; from Python each also costs its
// dispatch, its output's allocation, the views around it and the projection module's own call: ~100 us of
// a ~130 us layer beside the projections' arithmetic at one row on a 2-core AMX Xeon. Here a step calls the same C functions in the same order on buffers allocated once
// a step, so its results equal the op-by-op step's to the bit (tests/test_decode_stack.py).
// generator/model/stack.py builds the stack from a model's plan and says when a step can take it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <new>
#include <vector>

#include "checks.h"
#include "library.h"

namespace {

// generator/model/stack.py's KERNEL_CODES; NONE writes zeros (bench/stepsplit.py's steps without projections)
enum Kernel : int64_t { NONE = -1, GEMV = 0, GEMM8 = 1, AMX = 2 };
constexpr int ROLES = 4;                                    // qkv, o, gate_up, down

// one projection's weight as the library's kernels read it: gemv.c's (int4 nibbles, d, m or int8 q, s) and,
// where generator/model/quant.py has blocked it, gemm8.c's (w, d, m)
struct Projection {
    at::Tensor a, b, c, bw, bd, bm;
    bool q8 = false;
    int64_t k = 0, n = 0;
};

Projection projection(const std::vector<at::Tensor> &t) {
    TORCH_CHECK(t.size() == 6, "DecodeStack: a projection is [gemv w, d, m, blocked w, d, m], got ", t.size(),
                " tensors");
    Projection p;
    p.q8 = t[0].scalar_type() == at::kChar;
    TORCH_CHECK(t[0].dim() == 2 && (p.q8 || t[0].scalar_type() == at::kByte) && t[1].scalar_type() == at::kFloat,
                "DecodeStack: gemv.c's int4 (uint8 nibbles, fp32 d, m) or int8 (int8 q, fp32 s) weight expected");
    p.a = t[0].contiguous(), p.b = t[1].contiguous(), p.c = t[2].contiguous();
    p.n = t[0].size(0), p.k = p.q8 ? t[0].size(1) : 2 * t[0].size(1);
    if (t[3].numel()) {
        tokenpipe::check_blocked("DecodeStack", t[3], t[4], t[5], p.q8 ? 8 : 4, p.n);
        TORCH_CHECK(t[4].size(1) * 32 == p.k, "DecodeStack: a blocked weight of ", t[4].size(1), " groups for ",
                    p.k, " inputs");
        p.bw = t[3], p.bd = t[4], p.bm = t[5];
    }
    return p;
}

// y [M, n] = x [M, k] times p, on ``kernel``
void project(const Projection &p, int64_t kernel, const at::Tensor &x, at::Tensor &y, int threads, int bf16) {
    const long M = x.size(0);
    int failed;
    if (kernel == NONE) {
        std::memset(y.data_ptr(), 0, y.nbytes());
        return;
    }
    if (kernel == GEMV && p.q8)
        failed = tp_gemv_q8(p.a.data_ptr<int8_t>(), p.b.data_ptr<float>(), x.data_ptr(), y.data_ptr(), M, p.k, p.n,
                            threads, bf16);
    else if (kernel == GEMV)
        failed = tp_gemv_q4(p.a.data_ptr<uint8_t>(), p.b.data_ptr<float>(), p.c.data_ptr<float>(), x.data_ptr(),
                            y.data_ptr(), M, p.k, p.n, threads, bf16);
    else
        failed = tp_gemm8(p.bw.data_ptr<uint8_t>(), p.bd.data_ptr<float>(), p.bm.data_ptr<float>(), p.q8 ? 8 : 4,
                          x.data_ptr(), y.data_ptr(), M, p.k, p.n, threads, bf16, kernel == AMX);
    if (failed) throw std::bad_alloc();
}

struct Layer {
    at::Tensor in_norm, post_norm;
    std::array<Projection, ROLES> proj;  // qkv, o, gate_up, down
};

class DecodeStack : public torch::CustomClassHolder {
  public:
    DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
        : H_(heads), G_(kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
        TORCH_CHECK(H_ > 0 && G_ > 0 && H_ % G_ == 0 && hd_ % 16 == 0, "DecodeStack: ", H_, " heads over ", G_,
                    " kv heads of ", hd_, " (a multiple of 16) do not fit");
        blocked_.fill(true);
    }

    // a layer: its two RMSNorm weights [D] and its projections (see projection())
    void add_layer(at::Tensor in_norm, at::Tensor post_norm, std::vector<at::Tensor> qkv, std::vector<at::Tensor> o,
                   std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down) {
        Layer l{in_norm.contiguous(), post_norm.contiguous(),
                {projection(qkv), projection(o), projection(gate_up), projection(down)}};
        const int64_t D = in_norm.numel(), inter = l.proj[2].n / 2;
        TORCH_CHECK(in_norm.dim() == 1 && post_norm.sizes() == in_norm.sizes() &&
                    post_norm.scalar_type() == in_norm.scalar_type() &&
                    (in_norm.scalar_type() == at::kBFloat16 || in_norm.scalar_type() == at::kFloat) &&
                    (layers_.empty() || in_norm.scalar_type() == layers_[0].in_norm.scalar_type()),
                    "DecodeStack: RMSNorm weights [D] of one dtype, bf16 or fp32, expected");
        TORCH_CHECK(l.proj[0].k == D && l.proj[0].n == (H_ + 2 * G_) * hd_ && l.proj[1].k == H_ * hd_ &&
                    l.proj[1].n == D && l.proj[2].k == D && inter % 8 == 0 && l.proj[3].k == inter &&
                    l.proj[3].n == D && (layers_.empty() || D == layers_[0].in_norm.numel()),
                    "DecodeStack: the projections' shapes do not fit a layer of width ", D);
        for (int r = 0; r < ROLES; r++) blocked_[r] = blocked_[r] && l.proj[r].bw.defined();
        layers_.push_back(std::move(l));
    }

    // whether every layer's projection of ``role`` (0 qkv, 1 o, 2 gate_up, 3 down) has gemm8.c's layout
    bool blocked(int64_t role) const {
        TORCH_CHECK(role >= 0 && role < ROLES, "DecodeStack: role ", role, " of ", ROLES);
        return !layers_.empty() && blocked_[role];
    }

    // x [B, D] through every layer (returned, x untouched). cos, ssin [B, hd] (forward._rotary's); kv: each
    // layer's pool [2, G, blocks, 16, hd]; slots [B] (where this step's k, v go), tables [B, width], positions
    // [B]; kernels: one Kernel per role
    at::Tensor step(at::Tensor x, at::Tensor cos, at::Tensor ssin, std::vector<at::Tensor> kv, at::Tensor slots,
                    at::Tensor tables, at::Tensor positions, std::vector<int64_t> kernels) const {
        TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers");
        const Layer &first = layers_[0];
        const int64_t B = x.size(0), D = first.in_norm.numel(), inter = first.proj[2].n / 2;
        const auto dtype = first.in_norm.scalar_type();
        TORCH_CHECK(x.dim() == 2 && x.size(1) == D && x.scalar_type() == dtype, "DecodeStack: x [B, ", D, "] ",
                    dtype, " expected, got ", x.sizes(), " ", x.scalar_type());
        TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) == hd_ && ssin.sizes() == cos.sizes() &&
                    cos.scalar_type() == dtype && ssin.scalar_type() == dtype, "DecodeStack: cos, ssin [B, ", hd_,
                    "] expected");
        TORCH_CHECK(kernels.size() == ROLES, "DecodeStack: one kernel per role expected");
        for (int r = 0; r < ROLES; r++)
            TORCH_CHECK(kernels[r] == NONE || kernels[r] == GEMV || ((kernels[r] == GEMM8 || kernels[r] == AMX) && blocked_[r]),
                        "DecodeStack: kernel ", kernels[r], " for role ", r, " is not built");
        TORCH_CHECK(kv.size() == layers_.size(), "DecodeStack: one pool per layer expected, got ", kv.size());
        const int64_t nblocks = kv[0].dim() == 5 ? kv[0].size(2) : 0, pool = nblocks * 16;
        for (const at::Tensor &t : kv)
            TORCH_CHECK(t.dim() == 5 && t.size(0) == 2 && t.size(1) == G_ && t.size(2) == nblocks &&
                        t.size(3) == 16 && t.size(4) == hd_ && t.is_contiguous() && t.scalar_type() == dtype,
                        "DecodeStack: each pool [2, ", G_, ", blocks, 16, ", hd_, "] contiguous ", dtype,
                        " expected, got ", t.sizes());
        const at::Tensor sl = slots.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous(),
                         tab = tables.to(at::kLong).contiguous();
        TORCH_CHECK(sl.numel() == B && pos.numel() == B && tab.dim() == 2 && tab.size(0) == B,
                    "DecodeStack: slots [B], positions [B], tables [B, width] expected");
        const int64_t width = tab.size(1), *s = sl.data_ptr<int64_t>(), *p = pos.data_ptr<int64_t>(),
                      *t = tab.data_ptr<int64_t>();
        // rope_write's and paged_attention's checks, once a step
        tokenpipe::check_slots("DecodeStack", s, B, pool);
        tokenpipe::check_attended("DecodeStack", p, t, B, width, nblocks);
        const at::Tensor c = cos.contiguous(), ss = ssin.contiguous();
        const int threads = at::get_num_threads(), bf16 = dtype == at::kBFloat16;
        const auto opts = x.options();
        at::Tensor h = at::empty({B, D}, opts), qkv = at::empty({B, (H_ + 2 * G_) * hd_}, opts),
                   q = at::empty({B, H_, hd_}, opts), o = at::empty({B, H_ * hd_}, opts), a = at::empty({B, D}, opts),
                   gu = at::empty({B, 2 * inter}, opts), act = at::empty({B, inter}, opts);
        at::Tensor res = x.contiguous().clone();  // the residual stream
        const int64_t half = G_ * pool * hd_ * x.element_size();  // a pool's k, then its v
        for (size_t li = 0; li < layers_.size(); li++) {
            const Layer &l = layers_[li];
            char *k = static_cast<char *>(kv[li].data_ptr());
            tp_rms_norm(res.data_ptr(), l.in_norm.data_ptr(), h.data_ptr(), B, D, eps_, threads, bf16);
            project(l.proj[0], kernels[0], h, qkv, threads, bf16);
            tp_rope_write(qkv.data_ptr(), c.data_ptr(), ss.data_ptr(), q.data_ptr(), k, s, B, H_, G_, hd_, pool, bf16);
            if (tp_paged_attention(q.data_ptr(), k, k + half, t, p, o.data_ptr(), B, H_, G_, hd_, nblocks, width,
                                   scale_, threads, bf16))
                throw std::bad_alloc();
            project(l.proj[1], kernels[1], o, a, threads, bf16);
            tp_add_rows(res.data_ptr(), a.data_ptr(), B * D, bf16);
            tp_rms_norm(res.data_ptr(), l.post_norm.data_ptr(), h.data_ptr(), B, D, eps_, threads, bf16);
            project(l.proj[2], kernels[2], h, gu, threads, bf16);
            tp_silu_mul(gu.data_ptr(), act.data_ptr(), B, inter, threads, bf16);
            project(l.proj[3], kernels[3], act, a, threads, bf16);
            tp_add_rows(res.data_ptr(), a.data_ptr(), B * D, bf16);
        }
        return res;
    }

  private:
    int64_t H_, G_, hd_;
    float eps_, scale_;
    std::vector<Layer> layers_;
    std::array<bool, ROLES> blocked_{};
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenpipe, lib) {
    lib.class_<DecodeStack>("DecodeStack")
        .def(torch::init<int64_t, int64_t, int64_t, double, double>())
        .def("add_layer", &DecodeStack::add_layer)
        .def("blocked", &DecodeStack::blocked)
        .def("step", &DecodeStack::step);
}
