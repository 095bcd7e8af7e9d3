// The checks the C++ bindings (gemv_op.cpp's ops, stack_op.cpp's step) make before the library's C code
// reads or writes through raw pointers: one definition each, the op's name first in its message.
#ifndef TOKENPIPE_CHECKS_H
#define TOKENPIPE_CHECKS_H

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "library.h"

namespace tokenpipe {

// each of the n flat positions slots[b] (where a step writes K/V) inside a pool of ``positions``
inline void check_slots(const char *op, const int64_t *slots, int64_t n, int64_t positions) {
    for (int64_t b = 0; b < n; b++)
        TORCH_CHECK(slots[b] >= 0 && slots[b] < positions, op, ": slot ", slots[b], " outside the pool");
}

// row b attends positions 0..positions[b] through its row of tables [B, width]: inside the table, and every
// block id it reads inside a pool of ``nblocks`` blocks of 16
inline void check_attended(const char *op, const int64_t *positions, const int64_t *tables, int64_t B, int64_t width,
                           int64_t nblocks) {
    for (int64_t b = 0; b < B; b++) {
        TORCH_CHECK(positions[b] >= 0 && positions[b] < width * 16, op, ": row ", b, " attends position ",
                    positions[b], " beyond its table of ", width, " blocks");
        for (int64_t j = 0; j <= positions[b] / 16; j++)
            TORCH_CHECK(tables[b * width + j] >= 0 && tables[b * width + j] < nblocks, op, ": block id ",
                        tables[b * width + j], " outside the pool");
    }
}

// w [blocks, G * lanes * bits * 4] uint8, d, m [blocks, G, lanes] fp32, all contiguous: gemm8.c's layout of a
// weight of n output features
inline void check_blocked(const char *op, const at::Tensor &w, const at::Tensor &d, const at::Tensor &m,
                          int64_t bits, int64_t n) {
    const int64_t lanes = tp_gemm8_lanes();
    TORCH_CHECK(d.dim() == 3 && d.size(2) == lanes && m.sizes() == d.sizes() && w.dim() == 2 &&
                w.size(0) == d.size(0) && (bits == 4 || bits == 8) && w.size(1) == d.size(1) * lanes * bits * 4 &&
                n > (d.size(0) - 1) * lanes && n <= d.size(0) * lanes, op, ": a weight blocked for ", lanes,
                " lanes expected, got w ", w.sizes(), ", d ", d.sizes(), ", bits ", bits, ", n ", n);
    TORCH_CHECK(w.is_contiguous() && d.is_contiguous() && m.is_contiguous() && w.scalar_type() == at::kByte &&
                d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat, op, ": contiguous uint8 w and fp32 "
                "d, m expected");
}

}  // namespace tokenpipe

#endif
