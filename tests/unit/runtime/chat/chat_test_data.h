#pragma once
// Where the chat-template tests find their data: the Jinja goldens (tests/fixtures/chat, written by
// tools/gen_chat_goldens.py), the real tokenizers in ../shared/data/tokenizers and the template corpus in
// ../shared/data/chat_templates.
#include <gtest/gtest.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "runtime/chat/chat_template.h"

namespace capserve::runtime::testing {

inline std::filesystem::path chat_golden_path(std::string_view family) {
  return std::filesystem::path(CAPSERVE_FIXTURES_DIR) / "chat" / (std::string(family) + ".json");
}

// ../shared/data beside the checkout, or CAPSERVE_SHARED_DATA_DIR from the environment (a worktree elsewhere
// points it at the one shared copy).
inline std::filesystem::path shared_data_dir() {
  const char* env = std::getenv("CAPSERVE_SHARED_DATA_DIR");
  return env != nullptr ? std::filesystem::path(env) : std::filesystem::path(CAPSERVE_SHARED_DATA_DIR);
}

// The clock the Python goldens were rendered with: strftime_now() always sees 2025-01-15T10:30:00.
inline std::tm frozen_now() {
  std::tm t{};
  t.tm_year = 2025 - 1900;
  t.tm_mon = 0;
  t.tm_mday = 15;
  t.tm_hour = 10;
  t.tm_min = 30;
  t.tm_wday = 3;
  t.tm_yday = 14;
  return t;
}

inline std::filesystem::path shared_tokenizer_config(std::string_view model) {
  return shared_data_dir() / "tokenizers" / model / "tokenizer_config.json";
}

// Parses a JSON file; a missing file fails the test with a message saying what it is and where it comes from.
inline nlohmann::json read_test_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) {
    ADD_FAILURE() << "cannot open " << path
                  << " (chat goldens come from tools/gen_chat_goldens.py; real tokenizer configs from "
                     "../shared/data/tokenizers beside the checkout)";
    return nlohmann::json::object();
  }
  return nlohmann::json::parse(in);
}

// The real template corpus with its Python Jinja2 renders.
inline std::filesystem::path corpus_dir() {
  return shared_data_dir() / "chat_templates";
}

// The record whose "id" is `id` in one of the corpus' JSON-lines files, or with `scenario` the render of
// template `id` in that scenario (null when none).
inline nlohmann::ordered_json find_record(const std::string& file, const std::string& id,
                                          const std::string& scenario = "") {
  std::ifstream in(corpus_dir() / file);
  EXPECT_TRUE(in) << "cannot open " << corpus_dir() / file
                  << " (set CAPSERVE_SHARED_DATA_DIR to the shared data folder)";
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    nlohmann::ordered_json record = nlohmann::ordered_json::parse(line);
    if (scenario.empty() ? record.at("id") == id
                         : record.at("template_id") == id && record.at("scenario") == scenario)
      return record;
  }
  return nullptr;
}

// A corpus template as a checkpoint ships it: a tokenizer_config.json with its chat_template and special
// tokens.
inline ChatTemplate corpus_template(const std::string& id) {
  const nlohmann::ordered_json record = find_record("templates.jsonl", id);
  nlohmann::json config = nlohmann::json::parse(record.at("special_tokens").dump());
  config["chat_template"] = record.at("chat_template");
  return ChatTemplate::from_tokenizer_config(config, std::nullopt, id);
}

}  // namespace capserve::runtime::testing
