#pragma once
// The operations of a forward pass behind one backend-neutral interface, on tensors of the backend's device
// (kernels/tensor.h). Activations are float32 row-major tensors whose shapes say the sizes; weights are
// tensors in their stored dtype, uploaded once through upload() (on the CPU the mmapped checkpoint itself).
// One virtual call per operation per layer: every method works on a whole batch of tokens. Memory comes from
// the backend (allocate / scratch), and the host sees device data only through to_host, each call naming why
// the step needs it, so that a step's host synchronisations are few, named and counted.
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>

#include "kernels/buffer.h"
#include "kernels/dtype.h"
#include "kernels/sampling.h"
#include "kernels/tensor.h"

namespace capserve::kernels {

// One expert's SwiGLU weights: out = down(silu(gate(x)) * up(x)); gate/up are [ffn, hidden], down is [hidden,
// ffn].
struct ExpertWeights {
  Tensor gate;
  Tensor up;
  Tensor down;
};

// One paged KV-cache layer: k and v are [num_blocks, block_size, num_kv_heads, head_dim].
struct PagedKvLayer {
  Tensor k;
  Tensor v;
  std::int64_t block_size = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
};

// One paged latent-cache layer of multi-head latent attention: rows [num_blocks, block_size, kv_lora_rank +
// rope_dim], each a token's normalized KV latent followed by its rotated rope key (shared by all heads).
struct PagedLatentLayer {
  Tensor rows;
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

// Why a step copies device data to the host: every synchronisation point of a step has a name, and the
// backend counts them, so tests can assert how many a step makes.
enum class HostSync : std::uint8_t {
  sampled_tokens,  // per step: the sampled next tokens, which the scheduler needs
  logits,          // the logits themselves: only for scoring and dumps, never on the serving path
  count_           // the number of reasons
};

std::string_view host_sync_name(HostSync why);

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  [[nodiscard]] virtual Device device() const = 0;

  // A checkpoint weight (host memory) as a tensor on this backend's device [rows, cols]. The CPU backend
  // returns a view of the host memory itself (zero copy: it must outlive the tensor) and leaves `storage`
  // empty; a device backend copies it into `storage`, which the caller keeps as long as the tensor.
  [[nodiscard]] virtual Tensor upload(const WeightView& host, Buffer& storage) = 0;

  // At least `bytes` of device memory, aligned for every element type.
  [[nodiscard]] virtual Buffer allocate(std::size_t bytes) = 0;
  // A tensor of `shape` over `slot`, which is reallocated when too small: grow-only, so a warm step
  // allocates nothing. The contents are undefined.
  Tensor scratch(Buffer& slot, DType dtype, std::initializer_list<std::int64_t> shape);

  // Copies a tensor of this backend into host memory of its size; the host waits for it (a synchronisation
  // point, counted under `why`).
  void to_host(const Tensor& src, std::span<std::byte> dst, HostSync why);
  // Copies host memory into a tensor of this backend, of its size. The host does not wait; `src` must stay
  // valid until the backend's next to_host.
  void from_host(std::span<const std::byte> src, const Tensor& dst);
  // to_host calls since construction, per reason.
  [[nodiscard]] std::int64_t host_syncs(HostSync why) const {
    return host_syncs_[static_cast<std::size_t>(why)];
  }

  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when bias is not empty).
  virtual void linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y) = 0;

  // out[i, :] = table[ids[i], :]; ids is int32 [rows].
  virtual void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) = 0;

  // Row-wise RMSNorm of x [rows, cols] with a learned scale [cols]; out may alias x.
  virtual void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) = 0;

  // Rotary embedding in place on the `layout` part of x [tokens, heads * head_dim]; cos/sin are [tokens,
  // layout.dim / 2] for each token's position.
  virtual void rope(const Tensor& x, const RotaryLayout& layout, const Tensor& cos, const Tensor& sin) = 0;

  // dst += src, element-wise (the residual stream).
  virtual void add(const Tensor& dst, const Tensor& src) = 0;
  // dst[r, :] += sigmoid(gate[r]) * src[r, :]; gate is [rows] (a sigmoid-gated shared expert).
  virtual void add_sigmoid_gated(const Tensor& dst, const Tensor& src, const Tensor& gate) = 0;
  // x = clamp(x, -limit, limit), element-wise.
  virtual void clamp(const Tensor& x, float limit) = 0;
  // dst[i, :] = src[rows[i], :]; rows are host indices (step metadata).
  virtual void gather_rows(const Tensor& src, std::span<const std::int64_t> rows, const Tensor& dst) = 0;

  // Writes the new tokens' k/v rows [rows, num_kv_heads * head_dim] into their cache slots.
  virtual void kv_store(std::span<const SequenceSlice> seqs, const Tensor& k, const Tensor& v,
                        const PagedKvLayer& cache) = 0;

  // Causal (optionally sliding-window) grouped-query attention of each sequence's new queries
  // q [rows, num_heads * head_dim] over its cached keys/values; out [rows, num_heads * head_dim].
  virtual void paged_attention(std::span<const SequenceSlice> seqs, const Tensor& q,
                               const PagedKvLayer& cache, const AttentionParams& params,
                               const Tensor& out) = 0;

  // Writes the new tokens' latent rows [rows, kv_lora_rank] and rope keys [rows, rope_dim] into their cache
  // slots.
  virtual void latent_store(std::span<const SequenceSlice> seqs, const Tensor& latent, const Tensor& rope_key,
                            const PagedLatentLayer& cache) = 0;

  // Causal multi-head latent attention of each sequence's new queries q [rows, num_heads * (qk_nope_head_dim
  // + qk_rope_head_dim)] (rope part already rotated) over its cached latents; kv_b is kv_b_proj [num_heads *
  // (qk_nope_head_dim + v_head_dim), kv_lora_rank], per head its key rows then its value rows. out [rows,
  // num_heads * v_head_dim].
  virtual void latent_attention(std::span<const SequenceSlice> seqs, const Tensor& q,
                                const PagedLatentLayer& cache, const Tensor& kv_b,
                                const LatentAttentionParams& params, const Tensor& out) = 0;

  // SwiGLU experts over rows already grouped by expert: rows [offsets[e], offsets[e+1]) go through
  // experts[e]. x and out are [offsets.back(), hidden]; offsets are host values.
  virtual void grouped_expert_ffn(const Tensor& x, std::span<const std::int64_t> offsets,
                                  std::span<const ExpertWeights> experts, const Tensor& out) = 0;

  // tokens[r] (int32 [rows]) drawn from logits [rows, vocab] under controls[r] (host values): greedy takes
  // the first maximal id; otherwise temperature, top-k (ties to the lower id), top-p, then one draw
  // determined by (seed, step). A row with a NaN or infinite logit gets non_finite_token(its first such id).
  virtual void sample(const Tensor& logits, std::span<const SampleControls> controls,
                      const Tensor& tokens) = 0;

  // Thread count for the backend's own parallel loops and its BLAS.
  virtual void set_num_threads(int n) = 0;

 protected:
  // The copies of to_host and from_host, after their checks.
  virtual void copy_to_host(const Tensor& src, std::span<std::byte> dst) = 0;
  virtual void copy_from_host(std::span<const std::byte> src, const Tensor& dst) = 0;

 private:
  std::array<std::int64_t, static_cast<std::size_t>(HostSync::count_)> host_syncs_{};
};

}  // namespace capserve::kernels
