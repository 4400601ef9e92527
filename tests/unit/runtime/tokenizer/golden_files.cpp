#include "tests/unit/runtime/tokenizer/golden_files.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>

namespace capserve::runtime::testing {
namespace {

namespace fs = std::filesystem;

std::vector<std::string_view> split_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t end = std::min(text.find('\n', pos), text.size());
    lines.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  return lines;
}

std::string fnv1a64_hex(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : content) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::vector<std::int32_t> ids_of(const nlohmann::json& list) {
  return list.get<std::vector<std::int32_t>>();
}

}  // namespace

fs::path fixtures_dir() {
  return fs::path(CAPSERVE_FIXTURES_DIR) / "tokenizers";
}
fs::path source_dir() {
  return fs::path(CAPSERVE_SOURCE_DIR);
}

fs::path shared_data_dir() {
  const fs::path dir(CAPSERVE_SHARED_DATA_DIR);
  if (!fs::is_directory(dir / "tokenizers")) {
    throw std::runtime_error(
        "the shared data directory " + dir.string() +
        " (with tokenizers/) is missing: the tokenizer tests read the real tokenizer files "
        "from ../shared/data next to the repository");
  }
  return dir;
}

std::string read_gzip_file(const fs::path& path) {
  const std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  if (!file) throw std::runtime_error("cannot open " + path.string());
  std::string out;
  char buffer[1 << 16];
  int n = 0;
  while ((n = gzread(file.get(), buffer, sizeof buffer)) > 0) out.append(buffer, static_cast<std::size_t>(n));
  if (n < 0) throw std::runtime_error("cannot decompress " + path.string());
  return out;
}

std::vector<std::string> golden_names() {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(fixtures_dir())) {
    const std::string file = entry.path().filename().string();
    const std::string suffix = ".jsonl.gz";
    if (file.ends_with(suffix) && file != "strings.jsonl.gz")
      names.push_back(file.substr(0, file.size() - suffix.size()));
  }
  std::sort(names.begin(), names.end());
  return names;
}

const std::vector<std::string>& golden_strings() {
  static const std::vector<std::string> strings = [] {
    const std::string text = read_gzip_file(fixtures_dir() / "strings.jsonl.gz");
    std::vector<std::string> out;
    for (const std::string_view line : split_lines(text))
      out.push_back(nlohmann::json::parse(line).get<std::string>());
    return out;
  }();
  return strings;
}

Goldens load_goldens(const std::string& name) {
  const std::string text = read_gzip_file(fixtures_dir() / (name + ".jsonl.gz"));
  const std::vector<std::string_view> lines = split_lines(text);
  if (lines.empty()) throw std::runtime_error(name + ".jsonl.gz is empty");
  const nlohmann::json header = nlohmann::json::parse(lines[0]);
  Goldens g;
  g.name = name;
  const std::string root = header["where"]["root"].get<std::string>();
  const fs::path relative = header["where"]["path"].get<std::string>();
  g.tokenizer_dir = (root == "shared" ? shared_data_dir() : source_dir()) / relative;
  const fs::path json = g.tokenizer_dir / "tokenizer.json";
  if (!fs::exists(json))
    throw std::runtime_error(json.string() + " (the tokenizer of " + name + ") is missing");
  const std::string regenerate = "; regenerate with tools/.venv/bin/python tools/gen_tokenizer_goldens.py";
  if (fnv1a64_hex(json) != header["tokenizer_json_fnv1a64"].get<std::string>())
    throw std::runtime_error(json.string() + " changed since " + name + ".jsonl.gz was made" + regenerate);
  const std::vector<std::string>& strings = golden_strings();
  if (strings.size() != header["strings"].get<std::size_t>())
    throw std::runtime_error("strings.jsonl.gz does not match " + name + ".jsonl.gz" + regenerate);

  for (std::size_t k = 1; k < lines.size(); ++k) {
    const nlohmann::json record = nlohmann::json::parse(lines[k]);
    if (record.contains("decode_ids")) {
      g.decodings.push_back({ids_of(record["decode_ids"]), record["text"].get<std::string>(),
                             record["text_skip"].get<std::string>()});
      continue;
    }
    GoldenEncoding e;
    e.index = record["i"].get<std::size_t>();
    e.ids = ids_of(record["ids"]);
    if (record.contains("plain")) {
      e.has_plain = true;
      e.plain = ids_of(record["plain"]);
    }
    if (record.contains("decode")) {
      e.decoded = record["decode"].get<std::string>();
    } else {
      e.decoded = record.value("decode_prefix", std::string()) + strings.at(e.index);
    }
    g.encodings.push_back(std::move(e));
  }
  return g;
}

}  // namespace capserve::runtime::testing
