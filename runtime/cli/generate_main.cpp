// capserve-generate: single-process generation. From token ids it prints the new ids on one line; from
// --prompt text (optionally through the model's chat template) it prints the generated text.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/chat/chat_family.h"
#include "runtime/chat/chat_template.h"
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
  using namespace capserve;
  CLI::App app{"Generate tokens with a Hugging Face MoE checkpoint on the CPU"};
  std::string model_dir;
  std::string input_ids;
  std::string prompt;
  std::string system;
  std::string chat_family;
  bool chat = false;
  std::string dump_logits;
  runtime::SamplingParams params;
  bool ignore_eos = false;
  int threads = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  runtime::EngineOptions engine_options;
  app.add_option("--model", model_dir, "checkpoint directory (config.json + safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* ids_opt = app.add_option("--input-ids", input_ids, "prompt token ids, space-separated");
  auto* prompt_opt =
      app.add_option("--prompt", prompt, "prompt text (tokenized with the model's tokenizer.json)");
  ids_opt->excludes(prompt_opt);
  app.add_flag("--chat", chat, "wrap --prompt as a user turn in the model's chat template")
      ->needs(prompt_opt);
  app.add_option("--system", system, "system message for --chat")->needs("--chat");
  app.add_option("--chat-template", chat_family,
                 "force a chat template family (chatml, deepseek, llama2, mistral, tulu)")
      ->needs("--chat");
  app.add_option("--max-new-tokens", params.max_new_tokens, "tokens to generate")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", params.temperature, "0 = greedy")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", params.top_k, "keep the k most likely tokens (0 = off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", params.top_p, "nucleus mass in (0, 1]")->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", params.seed, "sampling seed");
  app.add_option("--stop-ids", params.stop_token_ids, "extra stop token ids");
  app.add_flag("--ignore-eos", ignore_eos, "do not stop at the model's eos_token_id");
  app.add_option("--dump-logits", dump_logits,
                 "write the logits of every generated position as float32 .npy [steps, vocab]");
  app.add_option("--threads", threads, "CPU threads")->check(CLI::PositiveNumber);
  app.add_option("--kv-blocks", engine_options.kv_blocks, "KV cache blocks of 16 tokens")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (input_ids.empty() && prompt.empty()) {
    std::fprintf(stderr, "capserve-generate: give --input-ids or --prompt\n");
    return 2;
  }

  try {
    const std::unique_ptr<runtime::Model> model = runtime::Model::load(model_dir);
    std::optional<runtime::Tokenizer> tokenizer;
    std::vector<std::int32_t> prompt_ids;
    if (prompt.empty()) {
      prompt_ids = parse_ids(input_ids);
    } else {
      tokenizer = runtime::Tokenizer::load(model_dir);
      std::string text = prompt;
      if (chat) {
        std::optional<runtime::ChatFamily> forced;
        if (!chat_family.empty()) forced = runtime::parse_family(chat_family);
        const auto chat_template =
            runtime::ChatTemplate::load(std::filesystem::path(model_dir) / "tokenizer_config.json", forced);
        std::vector<runtime::ChatMessage> messages;
        if (!system.empty()) messages.push_back({"system", system});
        messages.push_back({"user", prompt});
        if (runtime::Status s = chat_template.render(messages, true, text); !s.ok()) {
          std::fprintf(stderr, "capserve-generate: %s\n", s.message().c_str());
          return 2;
        }
      }
      // A rendered chat prompt already carries its special tokens as text.
      if (runtime::Status s = tokenizer->encode(text, !chat, prompt_ids); !s.ok()) {
        std::fprintf(stderr, "capserve-generate: --prompt: %s\n", s.message().c_str());
        return 2;
      }
    }
    if (!ignore_eos) {
      const auto& eos = model->config().eos_token_ids;
      params.stop_token_ids.insert(params.stop_token_ids.end(), eos.begin(), eos.end());
    }
    kernels::cpu::CpuBackend backend(threads);
    runtime::Engine engine(*model, backend, engine_options);
    std::vector<runtime::Generation> out;
    const std::vector<std::vector<std::int32_t>> prompts{prompt_ids};
    const std::vector<runtime::SamplingParams> all_params{params};
    if (runtime::Status s = runtime::generate(engine, prompts, all_params, !dump_logits.empty(), out);
        !s.ok()) {
      std::fprintf(stderr, "capserve-generate: %s\n", s.message().c_str());
      return 2;
    }
    if (tokenizer) {
      std::printf("%s\n", tokenizer->decode(out[0].tokens, true).c_str());
    } else {
      std::string line;
      for (const std::int32_t t : out[0].tokens) line += (line.empty() ? "" : " ") + std::to_string(t);
      std::printf("%s\n", line.c_str());
    }
    if (!dump_logits.empty()) {
      const std::int64_t shape[2] = {static_cast<std::int64_t>(out[0].tokens.size()),
                                     model->config().vocab_size};
      runtime::write_npy(dump_logits, out[0].logits, shape);
    }
  } catch (const CLI::Error& e) {
    return app.exit(e);
  } catch (const runtime::LoadError& e) {
    std::fprintf(stderr, "capserve-generate: %s\n", e.what());
    return 1;
  }
  return 0;
}
