// capserve-bench-tokenizer: single-thread encode throughput of the CapServe tokenizer on text files, one
// document per line. Prints one JSON line per file (the format tools/bench/bench_tokenizer.py reads for both
// contenders).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cli/version.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  return lines;
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  CLI::App app{"Single-thread encode throughput of the CapServe tokenizer"};
  capserve::runtime::add_common_flags(app, "capserve-bench-tokenizer");
  std::string dir;
  std::vector<std::string> files;
  int repeats = 3;
  app.add_option("--tokenizer", dir, "tokenizer directory")->required()->check(CLI::ExistingDirectory);
  app.add_option("--repeats", repeats, "timed passes per file (the fastest counts)")
      ->check(CLI::PositiveNumber);
  app.add_option("files", files, "text files, one document per line")->required()->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);

  const auto t0 = Clock::now();
  const capserve::runtime::Tokenizer tokenizer = capserve::runtime::Tokenizer::load(dir);
  const double load_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<std::int32_t> ids;
  for (const std::string& file : files) {
    const std::vector<std::string> lines = read_lines(file);
    std::size_t bytes = 0;
    for (const std::string& line : lines) bytes += line.size();
    double best = 1e30;
    std::size_t tokens = 0;
    for (int pass = 0; pass <= repeats; ++pass) {  // pass 0 warms caches and is not timed
      tokens = 0;
      const auto start = Clock::now();
      for (const std::string& line : lines) {
        if (!tokenizer.encode(line, false, ids).ok()) return 1;
        tokens += ids.size();
      }
      const double s = std::chrono::duration<double>(Clock::now() - start).count();
      if (pass > 0) best = std::min(best, s);
    }
    nlohmann::json result = {{"file", file},
                             {"bytes", bytes},
                             {"tokens", tokens},
                             {"seconds", best},
                             {"mb_per_s", bytes / best / 1e6},
                             {"load_s", load_s}};
    std::printf("%s\n", result.dump().c_str());
  }
  return 0;
}
