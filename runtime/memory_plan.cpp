#include "runtime/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <stdexcept>

#include "runtime/model.h"
#include "runtime/model_weights.h"

namespace capserve::runtime {
namespace {

// What a tensor is, from its name under the architecture's names, and whether it is a linear projection:
// the tensors a block-quantized FP8 checkpoint stores as F8_E4M3 (DeepSeek-V3 as released: every attention,
// dense-MLP and expert projection; embeddings, heads, norms, routers, biases and the MTP layer's eh_proj
// unquantized). test_memory_plan checks this against the FP8 fixture's stored types.
struct Role {
  WeightKind kind = WeightKind::attention;
  bool projection = false;
};

bool starts_with(std::string_view s, std::string_view prefix) {
  return !prefix.empty() && s.substr(0, prefix.size()) == prefix;
}

Role classify(std::string_view name, const ModelConfig& c, const TensorNames& n) {
  if (name == n.embed) return {WeightKind::embedding, false};
  if (name == n.lm_head) return {WeightKind::lm_head, false};
  if (name == n.final_norm) return {WeightKind::norms, false};
  constexpr std::string_view layers = "model.layers.";
  if (!starts_with(name, layers))
    throw std::logic_error("memory plan: unexpected tensor " + std::string(name));
  name.remove_prefix(layers.size());
  const std::size_t dot = name.find('.');
  std::int64_t layer = 0;
  std::from_chars(name.data(), name.data() + dot, layer);
  const std::string_view s = name.substr(dot + 1);
  const bool mtp = layer >= c.num_layers;
  const auto in_layer = [mtp](WeightKind kind, bool projection) {
    return Role{mtp ? WeightKind::mtp_layers : kind, projection};
  };
  if (starts_with(s, n.expert_prefix)) return in_layer(WeightKind::routed_experts, true);
  if (starts_with(s, n.shared_expert_prefix)) return in_layer(WeightKind::shared_experts, true);
  for (const std::string* router : {&n.router, &n.router_bias, &n.shared_expert_gate}) {
    if (!router->empty() && s == *router) return in_layer(WeightKind::routers, false);
  }
  for (const std::string* norm : {&n.input_norm, &n.post_attention_norm, &n.q_norm, &n.k_norm, &n.q_a_norm,
                                  &n.kv_a_norm, &n.mtp_enorm, &n.mtp_hnorm, &n.mtp_head_norm}) {
    if (!norm->empty() && s == *norm) return in_layer(WeightKind::norms, false);
  }
  for (const std::string* extra : {&n.mtp_eh_proj, &n.mtp_embed, &n.mtp_head}) {
    if (!extra->empty() && s == *extra) return {WeightKind::mtp_layers, false};
  }
  if (starts_with(s, n.dense_mlp_prefix)) return in_layer(WeightKind::dense_mlp, true);
  return in_layer(WeightKind::attention, s.ends_with(".weight"));
}

// The bytes one upload holds, as the Uploader (model_weights.cpp) counts them: the checkpoint's type, an FP8
// projection's bf16 dequantization (or its FP8 bytes and f32 block scales when kept, except kv_b_proj and a
// split inside a block), a router widened to f32 on a device, a correction bias always in f32.
std::int64_t held_bytes(const WeightShape& w, const Role& role, const ModelConfig& c,
                        const MemoryPlanOptions& o) {
  const std::int64_t numel = w.rows * w.cols;
  const auto size = [numel](kernels::DType t) {
    return numel * static_cast<std::int64_t>(kernels::dtype_size(t));
  };
  switch (w.fetch) {
    case WeightFetch::f32:
      return size(kernels::DType::f32);
    case WeightFetch::router:
      return size(o.device ? kernels::DType::f32 : *c.torch_dtype);
    case WeightFetch::bf16:
      return size(c.fp8_blocks && role.projection ? kernels::DType::bf16 : *c.torch_dtype);
    case WeightFetch::as_stored:
      break;
  }
  if (!c.fp8_blocks || !role.projection) return size(*c.torch_dtype);
  if (o.fp8 == Fp8Holding::dequantize_bf16) return size(kernels::DType::bf16);
  const std::int64_t scales = fp8_scale_rows(w.rows, *c.fp8_blocks) * fp8_scale_cols(w.cols, *c.fp8_blocks);
  return size(kernels::DType::f8_e4m3) +
         scales * static_cast<std::int64_t>(kernels::dtype_size(kernels::DType::f32));
}

}  // namespace

std::string_view weight_kind_name(WeightKind kind) {
  switch (kind) {
    case WeightKind::embedding:
      return "embedding";
    case WeightKind::lm_head:
      return "lm_head";
    case WeightKind::attention:
      return "attention";
    case WeightKind::norms:
      return "norms";
    case WeightKind::routers:
      return "routers";
    case WeightKind::dense_mlp:
      return "dense MLPs";
    case WeightKind::shared_experts:
      return "shared experts";
    case WeightKind::routed_experts:
      return "routed experts";
    case WeightKind::mtp_layers:
      return "MTP layers";
  }
  return "?";
}

std::int64_t RankMemoryPlan::weight_bytes() const {
  std::int64_t total = 0;
  for (const std::int64_t b : weights) total += b;
  return total;
}

std::int64_t MemoryPlan::kv_blocks() const {
  std::int64_t blocks = ranks.empty() ? 0 : ranks.front().kv_blocks;
  for (const RankMemoryPlan& r : ranks) blocks = std::min(blocks, r.kv_blocks);
  return blocks;
}

bool MemoryPlan::fits() const {
  return !ranks.empty() &&
         std::all_of(ranks.begin(), ranks.end(), [](const RankMemoryPlan& r) { return r.fits; });
}

MemoryPlan plan_memory(const ModelConfig& config, const TensorNames& names,
                       const MemoryPlanOptions& options) {
  if (options.device_memory <= 0)
    throw std::invalid_argument("memory plan: the device memory must be positive");
  if (options.ranks < 1) throw std::invalid_argument("memory plan: needs at least one rank");
  if (options.kv_block_size < 1)
    throw std::invalid_argument("memory plan: the KV block size must be positive");
  if (!config.torch_dtype)
    throw std::invalid_argument(
        "memory plan: config.json declares no torch_dtype (or dtype) of bfloat16, float16 or float32, the "
        "type "
        "its unquantized weights are stored in");
  MemoryPlan plan;
  plan.options = options;
  if (!plan.options.present) plan.options.present = [](std::string_view) { return true; };

  ParallelOptions parallel;
  parallel.placement = options.placement;
  parallel.redundant_experts = options.redundant_experts;
  parallel.mtp = options.mtp;
  const parallel::ExpertPlacement placement = model_placement(config, parallel, options.ranks);

  // The engine's cache (engine.cpp's engine_cache_shape): the decoder's layers and the loaded MTP layers.
  plan.kv = kv_cache_shape(config, options.kv_block_size, 0, options.kv_dtype);
  if (options.mtp) plan.kv.num_layers += static_cast<std::int64_t>(config.mtp_layer_is_moe.size());
  plan.kv_bytes_per_token = plan.kv.bytes_per_token_per_layer() * plan.kv.num_layers;
  plan.logits_bytes = options.max_batched_tokens * config.vocab_size *
                      static_cast<std::int64_t>(kernels::dtype_size(kernels::DType::f32));
  plan.required_kv_tokens = std::max(config.max_context_length(), options.max_batched_tokens);

  const std::int64_t block_bytes = plan.kv_bytes_per_token * options.kv_block_size;
  for (int rank = 0; rank < options.ranks; ++rank) {
    RankMemoryPlan r;
    r.rank = rank;
    for (std::int64_t l = 0; l < placement.num_layers(); ++l) {
      const bool moe = l < config.num_layers
                           ? config.layer_is_moe[static_cast<std::size_t>(l)]
                           : config.mtp_layer_is_moe[static_cast<std::size_t>(l - config.num_layers)];
      if (moe) r.experts += static_cast<std::int64_t>(placement.local_experts(l, rank).size());
    }
    for (const WeightShape& w :
         model_weight_shapes(config, names, placement, rank, options.mtp, plan.options.present)) {
      const Role role = classify(w.name, config, names);
      r.weights[static_cast<std::size_t>(role.kind)] += held_bytes(w, role, config, options);
    }
    r.kv_room = options.device_memory - options.reserve - r.weight_bytes();
    r.kv_blocks =
        options.kv_blocks > 0 ? options.kv_blocks : std::max<std::int64_t>(0, r.kv_room / block_bytes);
    r.kv_bytes = r.kv_blocks * block_bytes;
    r.fits = r.kv_bytes <= r.kv_room && r.kv_blocks * options.kv_block_size >= plan.required_kv_tokens;
    plan.ranks.push_back(r);
  }
  plan.kv.num_blocks = plan.kv_blocks();
  return plan;
}

std::int64_t parse_byte_size(std::string_view text) {
  const auto bad = [&] {
    return std::invalid_argument("'" + std::string(text) +
                                 "' is not a size (a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)");
  };
  std::size_t end = 0;
  while (end < text.size() && (std::isdigit(static_cast<unsigned char>(text[end])) != 0 || text[end] == '.'))
    ++end;
  if (end == 0) throw bad();
  double value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + end, value);
  if (ec != std::errc() || ptr != text.data() + end) throw bad();
  std::string unit;
  for (const char ch : text.substr(end))
    unit += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  static constexpr std::array<std::pair<std::string_view, double>, 14> kUnits{{{"", 1.0},
                                                                               {"B", 1.0},
                                                                               {"K", 1e3},
                                                                               {"KB", 1e3},
                                                                               {"M", 1e6},
                                                                               {"MB", 1e6},
                                                                               {"G", 1e9},
                                                                               {"GB", 1e9},
                                                                               {"T", 1e12},
                                                                               {"TB", 1e12},
                                                                               {"KIB", 0x1p10},
                                                                               {"MIB", 0x1p20},
                                                                               {"GIB", 0x1p30},
                                                                               {"TIB", 0x1p40}}};
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) {
      const double bytes = std::floor(value * scale);
      if (!(bytes <= 0x1p62)) throw bad();
      return static_cast<std::int64_t>(bytes);
    }
  }
  throw bad();
}

}  // namespace capserve::runtime
