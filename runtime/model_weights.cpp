#include "runtime/model_weights.h"

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "kernels/cpu/weight_convert.h"
#include "runtime/load_error.h"

namespace capserve::runtime {
namespace {

// Fetches checkpoint tensors (checked against their shapes) and uploads them through the backend; a device
// backend's copies are kept in `storage`, and then the host copies of dequantized FP8 weights are freed (the
// CPU's tensors are those host copies). Block-quantized FP8 weights stay FP8 for a backend that keeps them
// (Backend::keeps_fp8), with their scales; the others get them dequantized to bf16. One made with `read`
// false only checks each tensor (shape, FP8 scales) and marks it used, reading nothing, and gives empty
// tensors: the walk over layers the model does not run.
class Uploader {
 public:
  Uploader(Checkpoint& ckpt, kernels::Backend& backend, std::vector<kernels::Buffer>& storage,
           bool read = true)
      : ckpt_(ckpt), backend_(backend), storage_(storage), read_(read) {}

  [[nodiscard]] bool reads() const { return read_; }
  [[nodiscard]] bool contains(std::string_view name) const { return ckpt_.contains(name); }
  // What `get` checks, for a tensor this rank does not keep (another rank's expert).
  void check(std::string_view name, std::initializer_list<std::int64_t> shape) { ckpt_.check(name, shape); }
  kernels::Tensor get(std::string_view name, std::initializer_list<std::int64_t> shape) {
    if (!read_) {
      ckpt_.check(name, shape);
      return {};
    }
    const kernels::WeightView host = fetch(name, shape);
    kernels::Tensor t = upload(host);
    release(host);
    return t;
  }
  // `get`, but FP8 dequantized to bf16 whatever the backend keeps: kv_b_proj, which latent attention's
  // per-head batched GEMMs take in a 16-bit type (and which is small: DeepSeek-V3's 61 are 2 GB in bf16).
  kernels::Tensor get_bf16(std::string_view name, std::initializer_list<std::int64_t> shape) {
    if (!read_) return get(name, shape);
    const kernels::WeightView host = ckpt_.get(name, shape);
    kernels::Tensor t = upload(host);
    release(host);
    return t;
  }
  kernels::Tensor upload(const kernels::WeightView& host) {
    bytes_ += host.numel() * static_cast<std::int64_t>(kernels::dtype_size(host.dtype));
    if (!host.scales.empty())  // a device keeps f32 scales
      bytes_ += host.scales.grid_rows(host.rows) * host.scales.grid_cols(host.cols) *
                static_cast<std::int64_t>(sizeof(float));
    kernels::Buffer copy;
    kernels::Tensor t = backend_.upload(host, copy);
    if (copy.bytes() > 0) {
      storage_.push_back(std::move(copy));
      device_copies_ = true;
    }
    return t;
  }
  // On a device, in f32 whatever the checkpoint stores: a bf16 GEMM would round the activations to bf16 and
  // flip near-tied experts, where transformers and DeepSeek compute the router in f32. The CPU widens stored
  // weights exactly in every GEMM, so it keeps the zero-copy view.
  kernels::Tensor get_router(std::string_view name, std::initializer_list<std::int64_t> shape) {
    if (!read_) return get(name, shape);
    const kernels::WeightView host = ckpt_.get(name, shape);
    if (backend_.device() == kernels::kCpu || host.dtype == kernels::DType::f32) {
      kernels::Tensor t = upload(host);
      release(host);
      return t;
    }
    std::vector<float> wide(static_cast<std::size_t>(host.numel()));
    kernels::cpu::convert_to_f32(host.dtype, host.data, 0, host.numel(), wide.data());
    kernels::Tensor t =
        upload({kernels::DType::f32, reinterpret_cast<const std::byte*>(wide.data()), host.rows, host.cols});
    release(host);
    return t;
  }
  // In f32 whatever the checkpoint stores (BF16 and F16 widen exactly), with exactly `shape`: the router's
  // correction bias, which the kernels add to f32 scores.
  kernels::Tensor get_f32(std::string_view name, std::initializer_list<std::int64_t> shape) {
    if (!read_) return get(name, shape);
    const kernels::WeightView host = ckpt_.get_f32(name, shape);
    kernels::Tensor t = upload(host).reshaped(shape);
    release(host);
    return t;
  }
  // A matrix's rows [0, first) and [first, rows), or a vector's elements, as two tensors:
  // kv_a_proj_with_mqa's latent and rope-key parts, which the kernels take separately.
  std::pair<kernels::Tensor, kernels::Tensor> get_split(std::string_view name,
                                                        std::initializer_list<std::int64_t> shape,
                                                        std::int64_t first) {
    if (!read_) {
      ckpt_.check(name, shape);
      return {};
    }
    kernels::WeightView host = fetch(name, shape);
    // An FP8 matrix splits at a block's first row (DeepSeek-V3's 512 of 576 rows at 128); otherwise bf16.
    if (!host.scales.empty() && first % host.scales.block_rows != 0) host = ckpt_.get(name, shape);
    const bool vector = shape.size() == 1;
    const std::int64_t rest = (vector ? host.cols : host.rows) - first;
    std::pair<kernels::Tensor, kernels::Tensor> parts{
        upload(vector ? host.element_range(0, first) : host.row_range(0, first)),
        upload(vector ? host.element_range(first, rest) : host.row_range(first, rest))};
    release(host);
    return parts;
  }
  // The bytes of every tensor uploaded so far (an FP8 weight's with its f32 scales).
  [[nodiscard]] std::int64_t bytes() const { return bytes_; }
  // `host` (a view Checkpoint::get returned) is no longer needed once the device holds copies of it.
  void release(const kernels::WeightView& host) {
    if (device_copies_) ckpt_.release(host);
  }

 private:
  // The checkpoint's tensor, FP8 kept as stored where the backend keeps it.
  kernels::WeightView fetch(std::string_view name, std::initializer_list<std::int64_t> shape) {
    return backend_.keeps_fp8() ? ckpt_.get_stored(name, shape) : ckpt_.get(name, shape);
  }

  Checkpoint& ckpt_;
  kernels::Backend& backend_;
  std::vector<kernels::Buffer>& storage_;
  bool read_;
  bool device_copies_ = false;
  std::int64_t bytes_ = 0;
};

// Records what an Uploader would upload, by name, shape and fetch, without a checkpoint (the memory plan):
// every tensor is taken to have the shape the walk asks for, and optional ones (`contains`) to be present
// where `present` says so. One made with `read` false records nothing, as the checking Uploader uploads
// nothing.
class ShapeRecorder {
 public:
  // `fp8`: the checkpoint's FP8 block shape, for the split that falls back to bf16 as the Uploader's does.
  ShapeRecorder(std::vector<WeightShape>& out, const std::function<bool(std::string_view)>& present,
                std::optional<Fp8BlockShape> fp8, bool read = true)
      : out_(out), present_(present), fp8_(fp8), read_(read) {}

  [[nodiscard]] bool reads() const { return read_; }
  [[nodiscard]] bool contains(std::string_view name) const { return present_(name); }
  void check(std::string_view, std::initializer_list<std::int64_t>) {}
  kernels::Tensor get(std::string_view name, std::initializer_list<std::int64_t> shape) {
    return record(name, shape, WeightFetch::as_stored);
  }
  kernels::Tensor get_router(std::string_view name, std::initializer_list<std::int64_t> shape) {
    return record(name, shape, WeightFetch::router);
  }
  kernels::Tensor get_f32(std::string_view name, std::initializer_list<std::int64_t> shape) {
    return record(name, shape, WeightFetch::f32);
  }
  kernels::Tensor get_bf16(std::string_view name, std::initializer_list<std::int64_t> shape) {
    return record(name, shape, WeightFetch::bf16);
  }
  std::pair<kernels::Tensor, kernels::Tensor> get_split(std::string_view name,
                                                        std::initializer_list<std::int64_t> shape,
                                                        std::int64_t first) {
    if (!read_) return {};
    const std::vector<std::int64_t> s(shape);
    if (s.size() == 1) {
      out_.push_back({std::string(name), 1, first, WeightFetch::as_stored});
      out_.push_back({std::string(name), 1, s[0] - first, WeightFetch::as_stored});
    } else {
      const WeightFetch fetch = fp8_ && first % fp8_->rows != 0 ? WeightFetch::bf16 : WeightFetch::as_stored;
      out_.push_back({std::string(name), first, s[1], fetch});
      out_.push_back({std::string(name), s[0] - first, s[1], fetch});
    }
    return {};
  }

 private:
  kernels::Tensor record(std::string_view name, std::initializer_list<std::int64_t> shape,
                         WeightFetch fetch) {
    if (!read_) return {};
    const std::vector<std::int64_t> s(shape);
    out_.push_back({std::string(name), s.size() == 1 ? 1 : s[0], s.back(), fetch});
    return {};
  }

  std::vector<WeightShape>& out_;
  const std::function<bool(std::string_view)>& present_;
  std::optional<Fp8BlockShape> fp8_;
  bool read_;
};

// The walk below is written once over an uploader type: the Uploader (loading) or the ShapeRecorder (the
// memory plan), so that the plan sees exactly the tensors a load fetches.

// One SwiGLU's three matrices, checked against their shapes; uploaded only when `keep`.
template <class Up>
std::optional<kernels::ExpertWeights> load_swiglu(Up& up, const std::string& prefix, const std::string& gate,
                                                  const std::string& up_proj, const std::string& down,
                                                  std::int64_t hidden, std::int64_t ffn, bool keep = true) {
  if (!keep) {
    up.check(prefix + gate, {ffn, hidden});
    up.check(prefix + up_proj, {ffn, hidden});
    up.check(prefix + down, {hidden, ffn});
    return std::nullopt;
  }
  return kernels::ExpertWeights{up.get(prefix + gate, {ffn, hidden}), up.get(prefix + up_proj, {ffn, hidden}),
                                up.get(prefix + down, {hidden, ffn})};
}

template <class Up>
AttentionWeights load_latent_attention(Up& up, const ModelConfig& c, const TensorNames& n,
                                       const std::string& p) {
  const MlaConfig& m = *c.mla;
  const std::int64_t q_width = c.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
  const std::int64_t r = m.kv_lora_rank;
  const std::int64_t dr = m.qk_rope_head_dim;
  AttentionWeights a;
  if (m.q_lora_rank > 0) {
    a.q_a = up.get(p + n.q_a_proj + ".weight", {m.q_lora_rank, c.hidden_size});
    if (m.bias) a.q_a_bias = up.get(p + n.q_a_proj + ".bias", {m.q_lora_rank});
    a.q_a_norm = up.get(p + n.q_a_norm, {m.q_lora_rank});
    a.q_b = up.get(p + n.q_b_proj + ".weight", {q_width, m.q_lora_rank});
  } else {
    a.q = up.get(p + n.q_proj + ".weight", {q_width, c.hidden_size});
  }
  std::tie(a.kv_a_latent, a.kv_a_rope) =
      up.get_split(p + n.kv_a_proj + ".weight", {r + dr, c.hidden_size}, r);
  if (m.bias)
    std::tie(a.kv_a_latent_bias, a.kv_a_rope_bias) = up.get_split(p + n.kv_a_proj + ".bias", {r + dr}, r);
  a.kv_a_norm = up.get(p + n.kv_a_norm, {r});
  a.kv_b = up.get_bf16(p + n.kv_b_proj + ".weight", {c.num_heads * (m.qk_nope_head_dim + m.v_head_dim), r});
  a.o = up.get(p + n.o_proj + ".weight", {c.hidden_size, c.num_heads * m.v_head_dim});
  if (c.o_bias) a.o_bias = up.get(p + n.o_proj + ".bias", {c.hidden_size});
  return a;
}

template <class Up>
AttentionWeights load_attention(Up& up, const ModelConfig& c, const TensorNames& n, const std::string& p) {
  if (c.mla) return load_latent_attention(up, c, n, p);
  const std::int64_t q_width = c.num_heads * c.head_dim;
  const std::int64_t kv_width = c.num_kv_heads * c.head_dim;
  AttentionWeights a;
  a.q = up.get(p + n.q_proj + ".weight", {q_width, c.hidden_size});
  a.k = up.get(p + n.k_proj + ".weight", {kv_width, c.hidden_size});
  a.v = up.get(p + n.v_proj + ".weight", {kv_width, c.hidden_size});
  a.o = up.get(p + n.o_proj + ".weight", {c.hidden_size, q_width});
  if (c.qkv_bias) {
    a.q_bias = up.get(p + n.q_proj + ".bias", {q_width});
    a.k_bias = up.get(p + n.k_proj + ".bias", {kv_width});
    a.v_bias = up.get(p + n.v_proj + ".bias", {kv_width});
  }
  if (c.o_bias) a.o_bias = up.get(p + n.o_proj + ".bias", {c.hidden_size});
  if (c.qk_norm != QkNorm::none) {
    const bool per_head = c.qk_norm == QkNorm::per_head;
    a.q_norm = up.get(p + n.q_norm, {per_head ? c.head_dim : q_width});
    a.k_norm = up.get(p + n.k_norm, {per_head ? c.head_dim : kv_width});
  }
  return a;
}

// `hosted`: the experts this rank keeps, ascending (its slots' experts: ExpertPlacement::hosted_experts);
// empty on a layer walked without reading.
template <class Up>
MoeWeights load_moe(Up& up, const ModelConfig& c, const TensorNames& n, const std::string& p,
                    std::span<const std::int32_t> hosted) {
  MoeWeights m;
  m.router = up.get_router(p + n.router, {c.num_experts, c.hidden_size});
  if (c.router.correction_bias) m.router_bias = up.get_f32(p + n.router_bias, {c.num_experts});
  for (std::int64_t e = 0; e < c.num_experts; ++e) {
    // Every expert's tensors are checked, but only this rank's are kept: the others' pages are never touched.
    const bool keep = std::binary_search(hosted.begin(), hosted.end(), static_cast<std::int32_t>(e));
    std::optional<kernels::ExpertWeights> w =
        load_swiglu(up, p + n.expert_prefix + std::to_string(e) + ".", n.expert_gate, n.expert_up,
                    n.expert_down, c.hidden_size, c.moe_intermediate_size, keep);
    if (w) m.experts.push_back(std::move(*w));
  }
  if (c.shared_expert_intermediate_size > 0) {
    m.shared.push_back(*load_swiglu(up, p + n.shared_expert_prefix, "gate_proj.weight", "up_proj.weight",
                                    "down_proj.weight", c.hidden_size, c.shared_expert_intermediate_size));
    if (!n.shared_expert_gate.empty()) m.shared_gate = up.get(p + n.shared_expert_gate, {1, c.hidden_size});
  }
  return m;
}

template <class Up>
LayerWeights load_layer(Up& up, const ModelConfig& c, const TensorNames& n, const std::string& p, bool is_moe,
                        std::span<const std::int32_t> hosted) {
  LayerWeights layer;
  layer.input_norm = up.get(p + n.input_norm, {c.hidden_size});
  layer.post_attention_norm = up.get(p + n.post_attention_norm, {c.hidden_size});
  layer.attention = load_attention(up, c, n, p);
  layer.is_moe = is_moe;
  if (layer.is_moe) {
    layer.moe = load_moe(up, c, n, p, hosted);
  } else {
    layer.dense_mlp.push_back(*load_swiglu(up, p + n.dense_mlp_prefix, "gate_proj.weight", "up_proj.weight",
                                           "down_proj.weight", c.hidden_size, c.dense_intermediate_size));
  }
  return layer;
}

// Multi-token-prediction layer `i`: loaded through a reading uploader with this rank's experts (`hosted`),
// or only checked through one that does not read (speculation off). A checkpoint without the layer (no
// eh_proj) passes the check (and fails a load); one with part of it fails check_all_used.
template <class Up>
std::optional<MtpWeights> load_mtp_layer(Up& up, const ModelConfig& c, const TensorNames& n, std::int64_t i,
                                         std::span<const std::int32_t> hosted, const ModelWeights& model) {
  const std::int64_t l = c.num_layers + i;
  const std::string p = "model.layers." + std::to_string(l) + ".";
  if (!up.contains(p + n.mtp_eh_proj)) {
    if (up.reads())
      throw LoadError(c.architecture + ": speculative decoding with MTP needs multi-token-prediction layer " +
                      std::to_string(l) + ", which the checkpoint does not have (no '" + p + n.mtp_eh_proj +
                      "')");
    if constexpr (std::is_same_v<Up, Uploader>)
      spdlog::info("{}: the checkpoint has no multi-token-prediction layer {} (no '{}')", c.architecture, l,
                   p + n.mtp_eh_proj);
    return std::nullopt;
  }
  MtpWeights m;
  m.eh_proj = up.get(p + n.mtp_eh_proj, {c.hidden_size, 2 * c.hidden_size});
  m.enorm = up.get(p + n.mtp_enorm, {c.hidden_size});
  m.hnorm = up.get(p + n.mtp_hnorm, {c.hidden_size});
  m.head_norm = up.get(p + n.mtp_head_norm, {c.hidden_size});
  m.embed =
      up.contains(p + n.mtp_embed) ? up.get(p + n.mtp_embed, {c.vocab_size, c.hidden_size}) : model.embed;
  m.lm_head =
      up.contains(p + n.mtp_head) ? up.get(p + n.mtp_head, {c.vocab_size, c.hidden_size}) : model.lm_head;
  m.layer = load_layer(up, c, n, p, c.mtp_layer_is_moe[static_cast<std::size_t>(i)], hosted);
  if (!up.reads()) {
    if constexpr (std::is_same_v<Up, Uploader>)  // a load's news, not a plan's
      spdlog::info("{}: multi-token-prediction layer {} checked and not loaded (no MTP speculation)",
                   c.architecture, l);
    return std::nullopt;
  }
  return m;
}

// Every tensor a rank loads, in order: `up` uploads, `checker` only checks (the MTP layers when not loaded).
template <class Up>
ModelWeights walk_model(Up& up, Up& checker, const ModelConfig& c, const TensorNames& n,
                        const parallel::ExpertPlacement& placement, int rank, bool load_mtp) {
  ModelWeights w;
  w.embed = up.get(n.embed, {c.vocab_size, c.hidden_size});
  w.final_norm = up.get(n.final_norm, {c.hidden_size});
  w.lm_head = c.tie_word_embeddings ? w.embed : up.get(n.lm_head, {c.vocab_size, c.hidden_size});
  w.layers.resize(static_cast<std::size_t>(c.num_layers));
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const bool is_moe = c.layer_is_moe[static_cast<std::size_t>(l)];
    const std::vector<std::int32_t> hosted =
        is_moe ? placement.hosted_experts(l, rank) : std::vector<std::int32_t>{};
    w.layers[static_cast<std::size_t>(l)] =
        load_layer(up, c, n, "model.layers." + std::to_string(l) + ".", is_moe, hosted);
  }
  for (std::size_t i = 0; i < c.mtp_layer_is_moe.size(); ++i) {
    const auto layer = c.num_layers + static_cast<std::int64_t>(i);
    const bool moe = c.mtp_layer_is_moe[i];
    const std::vector<std::int32_t> hosted =
        load_mtp && moe ? placement.hosted_experts(layer, rank) : std::vector<std::int32_t>{};
    std::optional<MtpWeights> m =
        load_mtp_layer(load_mtp ? up : checker, c, n, static_cast<std::int64_t>(i), hosted, w);
    if (m) w.mtp.push_back(std::move(*m));
  }
  return w;
}

}  // namespace

ModelWeights load_model_weights(Checkpoint& ckpt, const ModelConfig& c, const TensorNames& n,
                                const parallel::ExpertPlacement& placement, int rank,
                                kernels::Backend& backend, bool load_mtp) {
  std::vector<kernels::Buffer> storage;
  Uploader up(ckpt, backend, storage);
  Uploader checker(ckpt, backend, storage, /*read=*/false);
  ModelWeights w = walk_model(up, checker, c, n, placement, rank, load_mtp);
  // Tied checkpoints sometimes still carry lm_head.weight; it is the same matrix, so accept it.
  if (c.tie_word_embeddings && ckpt.contains(n.lm_head)) ckpt.get(n.lm_head, {c.vocab_size, c.hidden_size});
  ckpt.check_all_used();
  w.storage = std::move(storage);
  w.bytes = up.bytes();
  return w;
}

std::vector<WeightShape> model_weight_shapes(const ModelConfig& c, const TensorNames& n,
                                             const parallel::ExpertPlacement& placement, int rank,
                                             bool load_mtp,
                                             const std::function<bool(std::string_view)>& present) {
  std::vector<WeightShape> shapes;
  ShapeRecorder up(shapes, present, c.fp8_blocks);
  ShapeRecorder checker(shapes, present, c.fp8_blocks, /*read=*/false);
  walk_model(up, checker, c, n, placement, rank, load_mtp);
  return shapes;
}

}  // namespace capserve::runtime
