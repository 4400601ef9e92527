#pragma once
// The row-wise and element-wise operations of the residual stream on the device, fp32 activations: embedding
// lookup (weights in any stored dtype), residual add, sigmoid-gated add, clamp and row gather. The device
// counterparts of the CPU backend's operations of the same names; pointers are device memory, work is queued
// on `stream`.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace capserve::kernels::cuda {

// out[i, :] = table[ids[i], :] widened to fp32; table is [table_rows, cols] in `dtype`. An id outside the
// table gives a row of NaN (the host validated ids before the step; the device never reads outside the
// table).
void embedding(const std::int32_t* ids, std::int64_t rows, const void* table, DType dtype,
               std::int64_t table_rows, std::int64_t cols, float* out, cudaStream_t stream);

// dst[i] += src[i] for i < n.
void add(float* dst, const float* src, std::int64_t n, cudaStream_t stream);

// dst[r, :] += sigmoid(gate[r]) * src[r, :] for r < rows.
void add_sigmoid_gated(float* dst, const float* src, const float* gate, std::int64_t rows, std::int64_t cols,
                       cudaStream_t stream);

// x[i] = clamp(x[i], -limit, limit) for i < n.
void clamp(float* x, std::int64_t n, float limit, cudaStream_t stream);

// dst[i, :] = src[rows[i], :] for i < count (rows: device array).
void gather_rows(const float* src, const std::int64_t* rows, std::int64_t count, std::int64_t cols,
                 float* dst, cudaStream_t stream);

// act[i] = silu(gate[i]) * up[i] for i < n (the SwiGLU of an expert FFN, fp32).
void swiglu(const float* gate, const float* up, std::int64_t n, float* act, cudaStream_t stream);

// For each row of logits [rows, vocab] holding a NaN or infinite value, tokens[row] =
// non_finite_token(its first such id) (kernels/sampling.h); other rows are left as they are.
void mark_non_finite_rows(const float* logits, std::int64_t rows, std::int64_t vocab, std::int32_t* tokens,
                          cudaStream_t stream);

}  // namespace capserve::kernels::cuda
