#pragma once
// Reading the tokenizer goldens written by tools/gen_tokenizer_goldens.py (gzip JSONL under
// tests/fixtures/tokenizers/) and finding the tokenizer directories they were made from.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace capserve::runtime::testing {

struct GoldenEncoding {
  std::size_t index = 0;          // into the shared strings
  std::vector<std::int32_t> ids;  // add_special_tokens=true
  bool has_plain = false;
  std::vector<std::int32_t> plain;  // add_special_tokens=false, for a subset
  std::string decoded;              // HF decode(ids, skip_special_tokens=false)
};

struct GoldenDecoding {
  std::vector<std::int32_t> ids;
  std::string text;       // skip_special_tokens=false
  std::string text_skip;  // skip_special_tokens=true
};

struct Goldens {
  std::string name;
  std::filesystem::path tokenizer_dir;
  std::vector<GoldenEncoding> encodings;
  std::vector<GoldenDecoding> decodings;
};

std::filesystem::path fixtures_dir();
std::filesystem::path shared_data_dir();  // ../shared/data next to the repository
std::filesystem::path source_dir();

// The names of all golden sets (every tests/fixtures/tokenizers/<name>.jsonl.gz but strings).
std::vector<std::string> golden_names();

// The shared strings, read once per process.
const std::vector<std::string>& golden_strings();

// Throws std::runtime_error with an actionable message for missing data or stale goldens.
Goldens load_goldens(const std::string& name);

std::string read_gzip_file(const std::filesystem::path& path);

}  // namespace capserve::runtime::testing
