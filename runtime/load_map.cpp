#include "runtime/load_map.h"

#include <cmath>
#include <fstream>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

namespace capserve::runtime {
namespace {

constexpr const char* kFormat = "capserve-load-map/1";

// Solves A X = B in place for a symmetric positive definite A (n x n) and B (n x m): Cholesky, then the two
// triangular solves per column. A system a few hundred features square needs no library.
void solve_spd(std::vector<double>& a, std::vector<double>& b, std::size_t n, std::size_t m) {
  for (std::size_t j = 0; j < n; ++j) {
    for (std::size_t k = 0; k < j; ++k) a[j * n + j] -= a[j * n + k] * a[j * n + k];
    if (!(a[j * n + j] > 0))
      throw std::runtime_error("LoadMap::fit: the ridge system is not positive definite");
    a[j * n + j] = std::sqrt(a[j * n + j]);
    for (std::size_t i = j + 1; i < n; ++i) {
      for (std::size_t k = 0; k < j; ++k) a[i * n + j] -= a[i * n + k] * a[j * n + k];
      a[i * n + j] /= a[j * n + j];
    }
  }
  for (std::size_t c = 0; c < m; ++c) {
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t k = 0; k < i; ++k) b[i * m + c] -= a[i * n + k] * b[k * m + c];
      b[i * m + c] /= a[i * n + i];
    }
    for (std::size_t i = n; i-- > 0;) {
      for (std::size_t k = i + 1; k < n; ++k) b[i * m + c] -= a[k * n + i] * b[k * m + c];
      b[i * m + c] /= a[i * n + i];
    }
  }
}

}  // namespace

LoadMap::LoadMap(LoadMapShape shape, double ridge, std::vector<double> weights)
    : shape_(std::move(shape)), ridge_(ridge), weights_(std::move(weights)) {}

LoadMap LoadMap::fit(const LoadMapShape& shape, std::span<const Sample> samples, double ridge) {
  const auto size = static_cast<std::size_t>(shape.moe_layers * shape.experts);
  if (samples.empty() || size == 0) throw std::invalid_argument("LoadMap::fit: no samples or an empty shape");
  if (!(ridge > 0)) throw std::invalid_argument("LoadMap::fit: the ridge penalty must be positive");
  const std::size_t in = size + 1;
  std::vector<double> a(in * in, 0.0), b(in * size, 0.0), x(in, 1.0);
  for (const Sample& s : samples) {
    if (s.dry_run.size() != size || s.routed.size() != size)
      throw std::invalid_argument("LoadMap::fit: a sample's sizes are not the shape's");
    std::copy(s.dry_run.begin(), s.dry_run.end(), x.begin());
    for (std::size_t i = 0; i < in; ++i) {
      for (std::size_t j = 0; j < in; ++j) a[i * in + j] += x[i] * x[j];
      for (std::size_t k = 0; k < size; ++k) b[i * size + k] += x[i] * s.routed[k];
    }
  }
  for (std::size_t i = 0; i < in; ++i) a[i * in + i] += ridge * static_cast<double>(samples.size());
  solve_spd(a, b, in, size);
  return {shape, ridge, std::move(b)};
}

void LoadMap::predict(std::span<const double> dry_run, std::span<double> out) const {
  const auto n = static_cast<std::size_t>(size());
  if (dry_run.size() != n || out.size() != n)
    throw std::invalid_argument("LoadMap::predict: spans of " + std::to_string(dry_run.size()) + " and " +
                                std::to_string(out.size()) + " entries, the map has " + std::to_string(n));
  const double* intercept = weights_.data() + n * n;
  std::copy(intercept, intercept + n, out.begin());
  for (std::size_t i = 0; i < n; ++i) {
    if (dry_run[i] == 0) continue;  // the dry run's counts are sparse: top-k of each layer's experts
    const double* row = weights_.data() + i * n;
    for (std::size_t k = 0; k < n; ++k) out[k] += dry_run[i] * row[k];
  }
}

void LoadMap::write(const std::filesystem::path& path, const std::string& provenance) const {
  const nlohmann::json j = {
      {"format", kFormat},
      {"provenance", provenance},
      {"model",
       {{"architecture", shape_.architecture},
        {"moe_layers", shape_.moe_layers},
        {"experts", shape_.experts},
        {"top_k", shape_.top_k}}},
      {"ridge", ridge_},
      {"layout",
       "weights[(i * size) + k], i < size: input i (dry-run count per token of MoE layer i / experts, "
       "expert i % experts); i = size: the intercept; k: output (same indexing), routed load per token"},
      {"weights", weights_}};
  std::ofstream f(path);
  f << j.dump() << '\n';
  if (!f) throw std::runtime_error("cannot write the load map " + path.string());
}

LoadMap LoadMap::read(const std::filesystem::path& path) {
  const auto fail = [&](const std::string& why) {
    return std::runtime_error("load map " + path.string() + ": " + why);
  };
  std::ifstream f(path);
  if (!f) throw fail("cannot be opened");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
    if (j.value("format", "") != kFormat)
      throw fail(std::string("not a map (\"format\" is not \"") + kFormat + "\")");
    const nlohmann::json& m = j.at("model");
    LoadMapShape shape{m.at("architecture").get<std::string>(), m.at("moe_layers").get<std::int64_t>(),
                       m.at("experts").get<std::int64_t>(), m.at("top_k").get<std::int64_t>()};
    // Keeps the products below in range; capserve-moe-fine has 256 inputs.
    constexpr std::int64_t kMaxInputs = 1 << 16;
    if (shape.moe_layers <= 0 || shape.experts <= 0 || shape.moe_layers > kMaxInputs ||
        shape.experts > kMaxInputs || shape.moe_layers * shape.experts > kMaxInputs)
      throw fail("a model of " + std::to_string(shape.moe_layers) + " MoE layers x " +
                 std::to_string(shape.experts) + " experts is outside what a map covers (1 to 65536 inputs)");
    auto weights = j.at("weights").get<std::vector<double>>();
    const auto n = static_cast<std::size_t>(shape.moe_layers * shape.experts);
    if (weights.size() != (n + 1) * n)
      throw fail(std::to_string(weights.size()) + " weights, " + std::to_string((n + 1) * n) + " expected");
    for (const double w : weights)
      if (!std::isfinite(w)) throw fail("a weight is not finite");
    const double ridge = j.at("ridge").get<double>();
    return {std::move(shape), ridge, std::move(weights)};
  } catch (const nlohmann::json::exception& e) {
    throw fail(e.what());
  }
}

}  // namespace capserve::runtime
