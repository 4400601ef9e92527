#pragma once
// The committed Hugging Face fixtures (tools/gen_model_fixtures.py): checkpoint + reference.json + .npy
// logits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/model_config.h"

namespace capserve::testing {

// CAPSERVE_FIXTURES_DIR in the environment names a relocated copy of tests/fixtures (the GPU bundle carries
// one, tools/gpu/README.md); otherwise the source tree's, compiled in.
inline std::filesystem::path fixture_models_dir() {
  const char* env = std::getenv("CAPSERVE_FIXTURES_DIR");
  const std::filesystem::path root = env != nullptr && *env != '\0' ? env : CAPSERVE_FIXTURES_DIR;
  return root / "models";
}

// Listed while the test program starts (parameterized suites): a missing folder is reported and lists
// nothing, which GoogleTest reports as a failing uninstantiated suite, rather than aborting before the first
// test.
inline std::vector<std::string> fixture_model_names() {
  std::vector<std::string> names;
  std::error_code error;
  if (!std::filesystem::is_directory(fixture_models_dir(), error)) {
    std::fprintf(stderr,
                 "fixture models not found at %s (set CAPSERVE_FIXTURES_DIR to a copy of tests/fixtures)\n",
                 fixture_models_dir().c_str());
    return names;
  }
  for (const auto& entry : std::filesystem::directory_iterator(fixture_models_dir())) {
    if (std::filesystem::exists(entry.path() / "reference.json"))
      names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

inline nlohmann::json fixture_reference(const std::string& name) {
  return runtime::read_json_file(fixture_models_dir() / name / "reference.json");
}

// max |a - b| / max |b|
inline double relative_max_diff(std::span<const float> a, std::span<const float> b) {
  double diff = 0.0;
  double scale = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
  }
  return diff / scale;
}

}  // namespace capserve::testing
