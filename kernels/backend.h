#pragma once
// The hot operations of a forward pass behind one backend-neutral interface. Activations are float32
// row-major matrices passed as spans with explicit shapes; weights are WeightViews in their stored dtype (no
// conversion copy). One virtual call per operation per layer: every method works on a whole batch of tokens.
#include <cstdint>
#include <span>

#include "kernels/dtype.h"

namespace capserve::kernels {

// One expert's SwiGLU weights: out = down(silu(gate(x)) * up(x)); gate/up are [ffn, hidden], down is [hidden,
// ffn].
struct ExpertWeights {
  WeightView gate;
  WeightView up;
  WeightView down;
};

// One paged KV-cache layer: k and v are [num_blocks, block_size, num_kv_heads, head_dim].
struct PagedKvLayer {
  std::span<float> k;
  std::span<float> v;
  std::int64_t block_size = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
};

// One paged latent-cache layer of multi-head latent attention: rows [num_blocks, block_size, kv_lora_rank +
// rope_dim], each a token's normalized KV latent followed by its rotated rope key (shared by all heads).
struct PagedLatentLayer {
  std::span<float> rows;
  std::int64_t block_size = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t rope_dim = 0;
};

// The new tokens of one sequence inside a ragged batch: rows [first_row, first_row + num_tokens) of the
// batch, at positions [start_pos, start_pos + num_tokens); its cache blocks in order.
struct SequenceSlice {
  std::int64_t first_row = 0;
  std::int64_t num_tokens = 0;
  std::int64_t start_pos = 0;
  std::span<const std::int32_t> block_table;
};

struct AttentionParams {
  std::int64_t num_heads = 0;
  float scale = 1.0F;
  std::int64_t sliding_window = 0;  // 0: full causal attention
};

// Which dims of each head a rotary embedding turns: x is [tokens, heads, head_dim] and the rotated part of a
// head is [offset, offset + dim). Pairs are (i, i + dim / 2) (rotate-half, most models) or (2i, 2i + 1)
// (interleaved: DeepSeek-V2's complex form).
struct RotaryLayout {
  std::int64_t heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t offset = 0;
  std::int64_t dim = 0;
  bool interleaved = false;
};

// The two ways to compute multi-head latent attention; both give the same result. Expanded: kv_b_proj turns
// every context latent into per-head keys and values, then ordinary attention. Absorbed: kv_b_proj's key
// half is folded into the queries and its value half applied after the softmax, so attention runs on the
// latents themselves — the context is never expanded, which wins when few queries meet a long context
// (decode).
enum class LatentForm : std::uint8_t { cheaper, absorbed, expanded };

struct LatentAttentionParams {
  std::int64_t num_heads = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  float scale = 1.0F;
  // cheaper: per sequence, whichever form needs fewer multiply-adds for its new tokens and context.
  LatentForm form = LatentForm::cheaper;
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when bias is not empty).
  virtual void linear(std::span<const float> x, std::int64_t m, const WeightView& w, const WeightView& bias,
                      std::span<float> y) = 0;

  // out[i, :] = table[ids[i], :]
  virtual void embedding(std::span<const std::int32_t> ids, const WeightView& table,
                         std::span<float> out) = 0;

  // Row-wise RMSNorm over `cols` with a learned scale; out may alias x.
  virtual void rms_norm(std::span<const float> x, std::int64_t cols, const WeightView& weight, float eps,
                        std::span<float> out) = 0;

  // Rotary embedding in place on the `layout` part of x [tokens, heads, head_dim]; cos/sin are [tokens,
  // layout.dim / 2] for each token's position.
  virtual void rope(std::span<float> x, const RotaryLayout& layout, std::span<const float> cos,
                    std::span<const float> sin) = 0;

  // Writes the new tokens' k/v rows [rows, num_kv_heads * head_dim] into their cache slots.
  virtual void kv_store(std::span<const SequenceSlice> seqs, std::span<const float> k,
                        std::span<const float> v, const PagedKvLayer& cache) = 0;

  // Causal (optionally sliding-window) grouped-query attention of each sequence's new queries
  // q [rows, num_heads * head_dim] over its cached keys/values; out [rows, num_heads * head_dim].
  virtual void paged_attention(std::span<const SequenceSlice> seqs, std::span<const float> q,
                               const PagedKvLayer& cache, const AttentionParams& params,
                               std::span<float> out) = 0;

  // Writes the new tokens' latent rows [rows, kv_lora_rank] and rope keys [rows, rope_dim] into their cache
  // slots.
  virtual void latent_store(std::span<const SequenceSlice> seqs, std::span<const float> latent,
                            std::span<const float> rope_key, const PagedLatentLayer& cache) = 0;

  // Causal multi-head latent attention of each sequence's new queries q [rows, num_heads, qk_nope_head_dim +
  // qk_rope_head_dim] (rope part already rotated) over its cached latents; kv_b is kv_b_proj [num_heads *
  // (qk_nope_head_dim + v_head_dim), kv_lora_rank], per head its key rows then its value rows. out [rows,
  // num_heads * v_head_dim].
  virtual void latent_attention(std::span<const SequenceSlice> seqs, std::span<const float> q,
                                const PagedLatentLayer& cache, const WeightView& kv_b,
                                const LatentAttentionParams& params, std::span<float> out) = 0;

  // SwiGLU experts over rows already grouped by expert: rows [offsets[e], offsets[e+1]) go through
  // experts[e]. x and out are [offsets.back(), hidden].
  virtual void grouped_expert_ffn(std::span<const float> x, std::span<const std::int64_t> offsets,
                                  std::span<const ExpertWeights> experts, std::span<float> out) = 0;

  // Thread count for the backend's own parallel loops and its BLAS.
  virtual void set_num_threads(int n) = 0;
};

}  // namespace capserve::kernels
