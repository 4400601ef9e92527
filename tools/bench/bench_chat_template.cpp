// capserve-bench-chat-template: how long rendering a chat prompt with the checkpoint's own Jinja template
// takes next to tokenizing the rendered prompt, single-threaded, over real prompts (JSON lines whose
// "question" or "prompt" field is a user message). Prints a Markdown table, one row per (model, prompt file).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

std::vector<std::string> read_user_messages(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  std::vector<std::string> messages;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json record = nlohmann::json::parse(line);
    for (const char* key : {"question", "prompt"}) {
      if (record.contains(key) && record[key].is_string()) {
        messages.push_back(record[key].get<std::string>());
        break;
      }
    }
  }
  return messages;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Chat-template rendering time against tokenization time"};
  std::vector<std::string> models;
  std::vector<std::string> files;
  int repeats = 3;
  app.add_option("--model", models, "directories with tokenizer.json and tokenizer_config.json")
      ->required()
      ->check(CLI::ExistingDirectory)
      ->allow_extra_args(false);
  app.add_option("--repeats", repeats, "timed passes (the fastest counts)")->check(CLI::PositiveNumber);
  app.add_option("files", files, "JSON-lines prompt files")->required()->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);

  std::printf(
      "| model | prompts | file | template load ms | render us/prompt | tokenize us/prompt | "
      "render / tokenize | prompt bytes | tokens/prompt |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const fs::path model : models) {
    const capserve::runtime::Tokenizer tokenizer = capserve::runtime::Tokenizer::load(model);
    // Loading (read tokenizer_config.json, parse the JSON and the template) happens once per server start;
    // the fastest of a few loads counts.
    double parse_s = 1e30;
    for (int pass = 0; pass <= repeats; ++pass) {
      const auto start = Clock::now();
      (void)capserve::runtime::ChatTemplate::load(model / "tokenizer_config.json");
      parse_s = std::min(parse_s, seconds_since(start));
    }
    const auto chat = capserve::runtime::ChatTemplate::load(model / "tokenizer_config.json");
    for (const fs::path file : files) {
      const std::vector<std::string> users = read_user_messages(file);
      double best_render = 1e30;
      double best_tokenize = 1e30;
      std::size_t bytes = 0;
      std::size_t tokens = 0;
      capserve::runtime::RenderedPrompt prompt;
      std::vector<std::int32_t> ids;
      for (int pass = 0; pass <= repeats; ++pass) {  // pass 0 warms caches and is not timed
        double render_s = 0;
        double tokenize_s = 0;
        bytes = 0;
        tokens = 0;
        for (const std::string& user : users) {
          const std::vector<capserve::runtime::ChatMessage> messages = {
              {"system", "You are a careful assistant. Answer step by step."}, {"user", user}};
          auto start = Clock::now();
          if (!chat.render(messages, {}, prompt).ok()) return 1;
          render_s += seconds_since(start);
          start = Clock::now();
          if (!tokenizer.encode(prompt.text, false, ids, prompt.content).ok()) return 1;
          tokenize_s += seconds_since(start);
          bytes += prompt.text.size();
          tokens += ids.size();
        }
        if (pass > 0) {
          best_render = std::min(best_render, render_s);
          best_tokenize = std::min(best_tokenize, tokenize_s);
        }
      }
      const double n = static_cast<double>(users.size());
      std::printf("| %s | %zu | %s | %.3f | %.2f | %.2f | %.2f | %.0f | %.1f |\n", model.filename().c_str(),
                  users.size(), file.filename().c_str(), parse_s * 1e3, best_render / n * 1e6,
                  best_tokenize / n * 1e6, best_render / best_tokenize, static_cast<double>(bytes) / n,
                  static_cast<double>(tokens) / n);
    }
  }
  return 0;
}
