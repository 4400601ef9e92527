// capserve-generate: offline generation, alone or under mpirun. From token ids it prints the new ids on one
// line per prompt; from --prompt text (optionally through the model's chat template) the generated text.
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "parallel/mpi_world.h"
#include "runtime/chat/chat_template.h"
#include "runtime/cli/cores.h"
#include "runtime/cli/flag_checks.h"
#include "runtime/cli/parallel_flags.h"
#include "runtime/cli/proc_status.h"
#include "runtime/cli/rank_devices.h"
#include "runtime/cli/speculation_flags.h"
#include "runtime/cli/version.h"
#include "runtime/engine.h"
#include "runtime/generator.h"
#include "runtime/load_error.h"
#include "runtime/model.h"
#include "runtime/npy.h"
#include "runtime/token_ids_text.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

std::vector<std::int32_t> parse_ids(const std::string& text) {
  std::vector<std::int32_t> ids;
  if (!capserve::runtime::parse_token_ids(text, ids))
    throw CLI::ValidationError("--input-ids", "'" + text + "' is not a list of token ids");
  if (ids.empty()) throw CLI::ValidationError("--input-ids", "needs at least one token id");
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  using namespace capserve;
  std::optional<parallel::MpiWorld> world;
  if (!parallel::start_mpi(world, argc, argv, "capserve-generate")) return 1;
  const int rank = world->rank();
  CLI::App app{
      "Generate tokens with a Hugging Face MoE checkpoint (on the CPU, or on GPUs with --device cuda); under "
      "mpirun the ranks share the experts (expert parallelism) and the prompts (data parallelism)"};
  capserve::runtime::add_common_flags(app, "capserve-generate");
  std::string model_dir;
  std::vector<std::string> input_ids;
  std::vector<std::string> prompts_text;
  std::string system;
  std::string chat_template_file;
  bool chat = false;
  std::string dump_logits;
  std::string moe_stats;
  runtime::SamplingParams params;
  bool ignore_eos = false;
  int threads = runtime::default_threads(world->local_size());
  std::string device = "cpu";
  std::string kv_dtype = "auto";
  runtime::EngineOptions engine_options;
  runtime::ParallelFlags parallel_flags;
  runtime::SpeculationConfig speculation;
  app.add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* ids_opt =
      app.add_option("--input-ids", input_ids, "prompt token ids, space-separated; repeat for more prompts");
  auto* prompt_opt =
      app.add_option("--prompt", prompts_text,
                     "prompt text (tokenized with the model's tokenizer.json); repeat for more prompts");
  ids_opt->excludes(prompt_opt);
  app.add_flag("--chat", chat, "wrap each --prompt as a user turn in the model's chat template")
      ->needs(prompt_opt);
  app.add_option("--system", system, "system message for --chat")->needs("--chat");
  app.add_option("--chat-template", chat_template_file,
                 "a Jinja chat template file to use instead of the checkpoint's own")
      ->check(CLI::ExistingFile)
      ->needs("--chat");
  app.add_option("--max-new-tokens", params.max_new_tokens, "tokens to generate")
      ->check(runtime::at_least(0));
  app.add_option("--temperature", params.temperature, "0 = greedy")->check(runtime::at_least(0));
  app.add_option("--top-k", params.top_k, "keep the k most likely tokens (0 = off)")
      ->check(runtime::at_least(0));
  app.add_option("--top-p", params.top_p, "nucleus mass in (0, 1]")->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", params.seed, "sampling seed");
  app.add_option("--stop-ids", params.stop_token_ids, "extra stop token ids");
  app.add_flag("--ignore-eos", ignore_eos, "do not stop at the model's eos_token_id");
  app.add_option("--dump-logits", dump_logits,
                 "write the logits of every generated position as float32 .npy [steps, vocab] (PATH, or "
                 "PATH with _<i> before the extension for prompt i when there are several)");
  app.add_option("--moe-stats", moe_stats, "write per-layer MoE statistics of the run as JSON (rank 0)");
  app.add_option("--threads", threads, "CPU threads per rank")->check(runtime::at_least(1));
  runtime::add_device_flag(app, device);
  runtime::add_kv_dtype_flag(app, kv_dtype);
  app.add_option("--kv-blocks", engine_options.kv_blocks, "KV cache blocks of 16 tokens per rank")
      ->check(runtime::at_least(1));
  app.add_option(
         "--fixed-exchange-tokens", engine_options.fixed_exchange_tokens,
         "steps of at most this many tokens (all ranks) exchange MoE rows in fixed-size blocks where the "
         "capacity factor bounds every expert; 0: never")
      ->check(runtime::at_least(0));
  runtime::add_parallel_flags(app, parallel_flags);
  runtime::add_speculation_flags(app, speculation);
  // Every rank parses the same flags; rank 0 alone prints.
  if (const std::optional<int> exit_code =
          runtime::parse_flags(app, argc, argv, "capserve-generate", rank == 0))
    return *exit_code;
  if (input_ids.empty() && prompts_text.empty()) {
    if (rank == 0) std::fprintf(stderr, "capserve-generate: give --input-ids or --prompt\n");
    return 2;
  }

  if (world->local_rank() == 0) {
    if (const std::string w =
            runtime::oversubscription_warning(threads, world->local_size(), runtime::available_cores());
        !w.empty())
      std::fprintf(stderr, "capserve-generate: warning: %s\n", w.c_str());
  }

  // Everything that can fail before the first collective is agreed on, so that no rank is left waiting.
  runtime::RankDevices devices;
  std::unique_ptr<runtime::Model> model;
  std::optional<runtime::Tokenizer> tokenizer;
  std::vector<std::vector<std::int32_t>> prompts;
  std::string failure;
  try {
    if (const std::string why = runtime::why_speculation_invalid(speculation); !why.empty())
      throw std::invalid_argument(why);
    devices = runtime::make_rank_devices(device, threads, *world);
    runtime::ParallelOptions options = runtime::finish_parallel_flags(parallel_flags);
    options.mtp = runtime::loads_mtp_layers(speculation);
    model = devices.load(model_dir, options);
    for (const std::string& ids : input_ids) prompts.push_back(parse_ids(ids));
    if (!prompts_text.empty()) {
      tokenizer = runtime::Tokenizer::load(model_dir);
      std::optional<runtime::ChatTemplate> chat_template;
      if (chat) {
        std::optional<std::filesystem::path> template_file;
        if (!chat_template_file.empty()) template_file = chat_template_file;
        chat_template = runtime::ChatTemplate::load(
            std::filesystem::path(model_dir) / "tokenizer_config.json", template_file);
      }
      for (const std::string& prompt : prompts_text) {
        std::string text = prompt;
        if (chat_template) {
          std::vector<runtime::ChatMessage> messages;
          if (!system.empty()) messages.push_back({"system", system});
          messages.push_back({"user", prompt});
          if (runtime::Status s = chat_template->render(messages, {}, text); !s.ok())
            throw runtime::LoadError(s.message());
        }
        // A rendered chat prompt already carries its special tokens as text.
        std::vector<std::int32_t> ids;
        if (runtime::Status s = tokenizer->encode(text, !chat, ids); !s.ok())
          throw runtime::LoadError("--prompt: " + s.message());
        prompts.push_back(std::move(ids));
      }
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (!failure.empty()) std::fprintf(stderr, "capserve-generate: rank %d: %s\n", rank, failure.c_str());
  if (!world->all_agree(failure.empty())) return 1;

  if (!ignore_eos) {
    const auto& eos = model->config().eos_token_ids;
    params.stop_token_ids.insert(params.stop_token_ids.end(), eos.begin(), eos.end());
  }
  // Prompt i runs on rank i % size.
  std::vector<std::vector<std::int32_t>> mine;
  std::vector<std::size_t> mine_index;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    if (static_cast<int>(i % static_cast<std::size_t>(world->size())) != rank) continue;
    mine.push_back(prompts[i]);
    mine_index.push_back(i);
  }
  engine_options.kv_dtype = runtime::kv_dtype_for(kv_dtype, model->backend().device());
  runtime::Engine engine(*model, engine_options);
  const std::unique_ptr<runtime::Drafter> drafter = runtime::make_drafter(speculation, engine);
  std::vector<runtime::Generation> out;
  const std::vector<runtime::SamplingParams> all_params(mine.size(), params);
  runtime::SpeculationStats speculation_stats;
  const runtime::Status status = runtime::generate(engine, mine, all_params, !dump_logits.empty(), out,
                                                   drafter.get(), &speculation_stats);
  if (!status.ok()) std::fprintf(stderr, "capserve-generate: rank %d: %s\n", rank, status.message().c_str());
  if (!world->all_agree(status.ok())) return 2;

  if (!dump_logits.empty()) {
    for (std::size_t j = 0; j < mine.size(); ++j) {
      std::filesystem::path path = dump_logits;
      if (prompts.size() > 1) {
        path.replace_filename(path.stem().string() + "_" + std::to_string(mine_index[j]) +
                              path.extension().string());
      }
      const std::int64_t shape[2] = {static_cast<std::int64_t>(out[j].tokens.size()),
                                     model->config().vocab_size};
      runtime::write_npy(path.string(), out[j].logits, shape);
    }
  }

  // Rank 0 prints every prompt's output in prompt order: [index, count, ids...] per prompt from each rank.
  std::vector<std::int32_t> packed;
  for (std::size_t j = 0; j < mine.size(); ++j) {
    packed.push_back(static_cast<std::int32_t>(mine_index[j]));
    packed.push_back(static_cast<std::int32_t>(out[j].tokens.size()));
    packed.insert(packed.end(), out[j].tokens.begin(), out[j].tokens.end());
  }
  const auto gathered = world->gather(std::as_bytes(std::span(packed)), 0);
  // Each rank's resident memory (all of it, and the part that is mapped checkpoint pages): with expert
  // parallelism a rank touches only its own experts' pages.
  const std::int64_t resident[2] = {runtime::self_status_kib("VmRSS:"), runtime::self_status_kib("RssFile:")};
  std::vector<std::int64_t> all_resident(2 * static_cast<std::size_t>(world->size()));
  devices.control->allgather(resident, all_resident);
  nlohmann::json stats = nlohmann::json::parse(engine.run_stats().to_json(
      parallel::describe(model->capacity()) + " placement=" + model->placement().kind() +
      " ranks=" + std::to_string(world->size())));
  for (int r = 0; r < world->size(); ++r) {
    stats["rank_resident_kib"].push_back(all_resident[2 * static_cast<std::size_t>(r)]);
    stats["rank_resident_file_kib"].push_back(all_resident[2 * static_cast<std::size_t>(r) + 1]);
  }
  if (drafter != nullptr) {
    // Per draft position, verified then kept, summed over the ranks.
    const auto k = static_cast<std::size_t>(drafter->max_drafts());
    std::vector<std::int64_t> counts(2 * k, 0);
    for (std::size_t j = 0; j < speculation_stats.proposed.size(); ++j) {
      counts[j] = speculation_stats.proposed[j];
      counts[k + j] = speculation_stats.accepted[j];
    }
    devices.control->allreduce_sum(counts);
    nlohmann::json& s = stats["speculation"];
    s["verified_per_position"] =
        std::vector<std::int64_t>(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(k));
    s["kept_per_position"] =
        std::vector<std::int64_t>(counts.begin() + static_cast<std::ptrdiff_t>(k), counts.end());
    std::int64_t verified = 0;
    std::int64_t kept = 0;
    std::string positions;
    for (std::size_t j = 0; j < k; ++j) {
      verified += counts[j];
      kept += counts[k + j];
      positions += " " + std::to_string(counts[k + j]) + "/" + std::to_string(counts[j]);
    }
    if (rank == 0) {
      std::fprintf(stderr,
                   "capserve-generate: speculative decoding: %lld of %lld drafts kept (%.1f%%); "
                   "kept/verified per position:%s\n",
                   static_cast<long long>(kept), static_cast<long long>(verified),
                   verified > 0 ? 100.0 * static_cast<double>(kept) / static_cast<double>(verified) : 0.0,
                   positions.c_str());
    }
  }
  const std::string stats_json = stats.dump(1);
  if (rank != 0) return 0;
  std::vector<std::vector<std::int32_t>> results(prompts.size());
  for (const std::vector<std::byte>& bytes : gathered) {
    std::vector<std::int32_t> ints(bytes.size() / sizeof(std::int32_t));
    std::memcpy(ints.data(), bytes.data(), ints.size() * sizeof(std::int32_t));
    for (std::size_t i = 0; i < ints.size();) {
      const auto index = static_cast<std::size_t>(ints[i]);
      const auto count = static_cast<std::size_t>(ints[i + 1]);
      results[index].assign(ints.begin() + static_cast<std::ptrdiff_t>(i + 2),
                            ints.begin() + static_cast<std::ptrdiff_t>(i + 2 + count));
      i += 2 + count;
    }
  }
  for (const std::vector<std::int32_t>& tokens : results) {
    if (tokenizer) {
      std::printf("%s\n", tokenizer->decode(tokens, true).c_str());
    } else {
      std::string line;
      for (const std::int32_t t : tokens) line += (line.empty() ? "" : " ") + std::to_string(t);
      std::printf("%s\n", line.c_str());
    }
  }
  if (!moe_stats.empty()) {
    std::ofstream file(moe_stats);
    file << stats_json << "\n";
    if (!file) {
      std::fprintf(stderr, "capserve-generate: cannot write %s\n", moe_stats.c_str());
      return 1;
    }
  }
  return 0;
}
