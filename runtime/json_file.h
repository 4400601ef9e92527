#pragma once
// Reads a JSON file (config.json, tokenizer.json, ...) whole; a missing file or invalid JSON is a LoadError
// naming the path. Header-only so that every runtime library can use it without linking another.
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "runtime/load_error.h"

namespace capserve::runtime {

inline nlohmann::json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw LoadError("cannot open " + path.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw LoadError(path.string() + ": invalid JSON: " + e.what());
  }
}

}  // namespace capserve::runtime
