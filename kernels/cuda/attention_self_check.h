#pragma once
// The start-up self-check of the tensor-core attention: on the user's device, the fast kernel and the fp32
// reference kernel (paged_attention) run the same random problem of the loaded model's shapes, and the
// fast one is used only if they agree. No machine that builds this code has a GPU; this is how a kernel that
// misbehaves on a device (a driver, an architecture, a compiler) defends the user's answers instead of
// corrupting them.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>

#include "kernels/cuda/flash_attention.h"

namespace capserve::kernels::cuda {

// The kernel under check (flash_attention in product use; tests pass a broken one).
using FastAttention = std::function<void(const DeviceAttentionBatch&, const SharedKvAttention&,
                                         const FlashWorkspace&, cudaStream_t)>;

// The shapes a check runs: grouped-query attention, or the latent core (one K/V head, values the keys' first
// dv dims).
struct FastAttentionShape {
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t dk = 0;
  std::int64_t dv = 0;
  std::int64_t block_size = 0;
  std::int64_t sliding_window = 0;
  bool latent = false;
  friend bool operator==(const FastAttentionShape&, const FastAttentionShape&) = default;
};

struct KernelCheck {
  std::string kernel;  // what was checked, with its shape
  double error = 0.0;  // relative (root-mean-square) difference from the reference, inf if not finite
  double tolerance = 0.0;
  [[nodiscard]] bool passed() const { return error <= tolerance; }
  // One line for the start-up log: the figures, and what the backend does about them.
  [[nodiscard]] std::string summary() const;
};

// The relative difference of the fp32 kernel (paged_attention, or latent_attention_core) and `fast` over a
// bf16 cache of this shape: a prefill after a cached context, a chunk and decodes, contexts of several key
// tiles, a fixed seed. Synchronises the stream. `workspace` is the one the backend serves with, so that
// split-K runs as it will.
KernelCheck check_fast_attention(const FastAttentionShape& shape, const FastAttention& fast,
                                 const FlashWorkspace& workspace, cudaStream_t stream);

}  // namespace capserve::kernels::cuda
