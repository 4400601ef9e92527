#include "tools/eval/heldout_corpus.h"

#include <cmath>
#include <fstream>
#include <iterator>

#include "runtime/load_error.h"

namespace capserve::tools {

std::string read_corpus_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw runtime::LoadError("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

namespace {

// Where the held-out part starts.
std::size_t heldout_start(const std::string& data, double fraction) {
  const auto cut = static_cast<std::size_t>(std::floor(static_cast<double>(data.size()) * (1.0 - fraction)));
  const std::size_t nl = data.find('\n', cut);
  return nl == std::string::npos ? data.size() : nl + 1;
}

}  // namespace

std::string heldout_text(const std::string& data, double fraction) {
  return data.substr(heldout_start(data, fraction));
}

std::string training_text(const std::string& data, double fraction) {
  return data.substr(0, heldout_start(data, fraction));
}

}  // namespace capserve::tools
