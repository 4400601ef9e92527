// capserve-memory-plan: what each rank of a model would hold, from its config.json alone (no weights), and
// whether it fits devices of a given memory (runtime/README.md, "Memory plan").
#include <charconv>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "runtime/cli/flag_checks.h"
#include "runtime/cli/version.h"
#include "runtime/memory_plan.h"
#include "runtime/model.h"

namespace {

using capserve::runtime::MemoryPlan;
using capserve::runtime::RankMemoryPlan;
using capserve::runtime::WeightKind;

std::string gb(std::int64_t bytes) {
  return fmt::format("{:.2f}", static_cast<double>(bytes) / 1e9);
}

// --reserve: a size, or a percentage of --device-memory.
std::int64_t parse_reserve(const std::string& text, std::int64_t device_memory) {
  if (text.empty() || text.back() != '%') return capserve::runtime::parse_byte_size(text);
  double percent = -1;
  const char* end = text.data() + text.size() - 1;
  const auto [ptr, ec] = std::from_chars(text.data(), end, percent);
  if (ec != std::errc() || ptr != end || !(percent >= 0 && percent <= 100))
    throw std::invalid_argument("--reserve: '" + text + "' is not a percentage of 0 to 100");
  return static_cast<std::int64_t>(static_cast<double>(device_memory) * percent / 100.0);
}

void print(const MemoryPlan& plan, const capserve::runtime::ModelConfig& c, const std::string& path,
           const std::string& reserve_text) {
  const auto& o = plan.options;
  std::int64_t moe_layers = 0;
  for (const bool moe : c.layer_is_moe) moe_layers += moe ? 1 : 0;
  std::printf("%s from %s: %lld layers (%lld MoE), %lld routed experts, top-%lld; %zu MTP layer(s), %s\n",
              c.architecture.c_str(), path.c_str(), static_cast<long long>(c.num_layers),
              static_cast<long long>(moe_layers), static_cast<long long>(c.num_experts),
              static_cast<long long>(c.top_k), c.mtp_layer_is_moe.size(),
              o.mtp ? "loaded (--mtp)" : "not loaded");
  const std::string fp8 = !c.fp8_blocks ? "unquantized"
                          : o.fp8 == capserve::runtime::Fp8Holding::keep_fp8
                              ? fmt::format("FP8 projections kept FP8 ({}x{} blocks, one f32 scale each)",
                                            c.fp8_blocks->rows, c.fp8_blocks->cols)
                              : "FP8 projections dequantized to bf16";
  std::printf("%d ranks of %s GB; weights stored %s, %s; routers %s\n", o.ranks, gb(o.device_memory).c_str(),
              std::string(capserve::kernels::dtype_name(*c.torch_dtype)).c_str(), fp8.c_str(),
              o.device ? "in f32 (a device)" : "as stored (the CPU)");
  std::printf(
      "KV cache: %s %s of %lld values per token and layer, %lld layers: %lld bytes per token; blocks of %lld "
      "tokens\n",
      std::string(capserve::kernels::dtype_name(plan.kv.dtype)).c_str(),
      plan.kv.latent() ? "latent rows" : "K and V",
      static_cast<long long>(plan.kv.latent() ? plan.kv.kv_lora_rank + plan.kv.rope_dim
                                              : plan.kv.num_kv_heads * plan.kv.head_dim),
      static_cast<long long>(plan.kv.num_layers), static_cast<long long>(plan.kv_bytes_per_token),
      static_cast<long long>(plan.kv.block_size));
  std::printf(
      "reserve: %s GB (%s) for the step buffers (not counted; the largest, the f32 logits of "
      "--max-batched-tokens %lld rows, is %s GB), workspaces and the CUDA context\n\n",
      gb(o.reserve).c_str(), reserve_text.c_str(), static_cast<long long>(o.max_batched_tokens),
      gb(plan.logits_bytes).c_str());

  std::string header = fmt::format("{:>4} {:>7}", "rank", "experts");
  for (std::size_t k = 0; k < capserve::runtime::kWeightKinds; ++k)
    header += fmt::format(" {:>14}", capserve::runtime::weight_kind_name(static_cast<WeightKind>(k)));
  header += fmt::format(" {:>10} {:>11} {:>10}  {}", "weights", "KV room", "KV tokens", "");
  std::printf("%s  (GB)\n", header.c_str());
  for (const RankMemoryPlan& r : plan.ranks) {
    std::string line = fmt::format("{:>4} {:>7}", r.rank, r.experts);
    for (const std::int64_t b : r.weights) line += fmt::format(" {:>14}", gb(b));
    line += fmt::format(" {:>10} {:>11} {:>10}  {}", gb(r.weight_bytes()), gb(r.kv_room),
                        r.kv_blocks * plan.kv.block_size, r.fits ? "FITS" : "DOES NOT FIT");
    std::printf("%s\n", line.c_str());
  }
  std::printf(
      "\nevery rank: --kv-blocks %lld (%lld tokens, %s GB of KV cache); needed: %lld tokens (one "
      "sequence of the model's %lld-token context, and one step of --max-batched-tokens)\n",
      static_cast<long long>(plan.kv_blocks()), static_cast<long long>(plan.kv_tokens()),
      gb(plan.kv_tokens() * plan.kv_bytes_per_token).c_str(), static_cast<long long>(plan.required_kv_tokens),
      static_cast<long long>(c.max_context_length()));
  std::printf("%s\n", plan.fits() ? "FITS" : "DOES NOT FIT");
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  using namespace capserve;
  CLI::App app{
      "What each rank of a model would hold (weights by kind, KV cache) from its config.json alone, and "
      "whether weights + reserve + KV fit devices of --device-memory"};
  runtime::add_common_flags(app, "capserve-memory-plan");
  std::string config_path;
  std::string memory_text;
  std::string reserve_text = "10%";
  std::string kv_dtype = "bf16";
  std::string device = "cuda";
  runtime::MemoryPlanOptions options;
  options.max_batched_tokens = 2048;  // capserve's default
  app.add_option("--model-config", config_path, "a checkpoint's config.json (no weights needed)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--ranks", options.ranks, "expert-parallel ranks (one device each)")
      ->check(runtime::at_least(1));
  app.add_option("--device-memory", memory_text, "memory of each rank's device: 141GB, 80GiB, ...")
      ->required();
  app.add_option("--reserve", reserve_text,
                 "kept back from the KV cache for step buffers, workspaces and the CUDA context: a size or a "
                 "percentage of --device-memory");
  app.add_option("--kv-dtype", kv_dtype, "K/V (or latent) cache elements")
      ->check(CLI::IsMember({"bf16", "f32"}));
  app.add_option("--kv-block-size", options.kv_block_size, "tokens per KV block")
      ->check(runtime::at_least(1));
  app.add_option("--kv-blocks", options.kv_blocks,
                 "a fixed KV block count per rank (default: as many as the memory leaves)")
      ->check(runtime::at_least(1));
  app.add_option("--max-batched-tokens", options.max_batched_tokens, "tokens per step, all ranks")
      ->check(runtime::at_least(1));
  std::string fp8;
  app.add_option("--fp8", fp8,
                 "how a device holds block-quantized FP8 weights: keep or dequantize (default: as --device's "
                 "backend does: cuda keeps them, cpu dequantizes)")
      ->check(CLI::IsMember({"keep", "dequantize"}));
  app.add_option("--device", device,
                 "cuda: routers widened to f32 on the device; cpu: every weight as the checkpoint stores it")
      ->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--expert-placement", options.placement,
                 "contiguous, round-robin, or a --moe-stats JSON file (balanced)");
  app.add_option("--redundant-experts", options.redundant_experts,
                 "extra expert copies per MoE layer over all ranks (needs a --moe-stats file)")
      ->check(runtime::at_least(0));
  app.add_flag("--mtp", options.mtp, "the MTP layers loaded (--speculative mtp)");
  if (const std::optional<int> exit_code =
          runtime::parse_flags(app, argc, argv, "capserve-memory-plan", true))
    return *exit_code;
  try {
    const runtime::ModelDescription model = runtime::read_model_config(config_path);
    options.device = device == "cuda";
    const bool keep = fp8.empty() ? options.device : fp8 == "keep";
    options.fp8 = keep ? runtime::Fp8Holding::keep_fp8 : runtime::Fp8Holding::dequantize_bf16;
    options.kv_dtype = kv_dtype == "f32" ? kernels::DType::f32 : kernels::DType::bf16;
    options.device_memory = runtime::parse_byte_size(memory_text);
    options.reserve = parse_reserve(reserve_text, options.device_memory);
    const runtime::MemoryPlan plan = runtime::plan_memory(model.config, model.names, options);
    print(plan, model.config, config_path, reserve_text);
    return plan.fits() ? 0 : 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "capserve-memory-plan: %s\n", e.what());
    return 1;
  }
}
