#pragma once
// What speculative decoding achieved, per draft position: drafts verified and drafts kept.
#include <cstdint>
#include <vector>

namespace capserve::runtime {

struct SpeculationStats {
  std::vector<std::int64_t> proposed;  // [j]: drafts verified at draft position j (0 = right after the token)
  std::vector<std::int64_t> accepted;  // [j]: of those, the ones the verification kept

  // One verified item: `drafts` drafts fed, the first `kept` of them kept.
  void record(std::size_t drafts, std::size_t kept) {
    if (proposed.size() < drafts) {
      proposed.resize(drafts, 0);
      accepted.resize(drafts, 0);
    }
    for (std::size_t j = 0; j < drafts; ++j) {
      ++proposed[j];
      if (j < kept) ++accepted[j];
    }
  }
  void add(const SpeculationStats& other) {
    if (proposed.size() < other.proposed.size()) {
      proposed.resize(other.proposed.size(), 0);
      accepted.resize(other.proposed.size(), 0);
    }
    for (std::size_t j = 0; j < other.proposed.size(); ++j) {
      proposed[j] += other.proposed[j];
      accepted[j] += other.accepted[j];
    }
  }
  [[nodiscard]] std::int64_t total_proposed() const {
    std::int64_t n = 0;
    for (const std::int64_t p : proposed) n += p;
    return n;
  }
  [[nodiscard]] std::int64_t total_accepted() const {
    std::int64_t n = 0;
    for (const std::int64_t a : accepted) n += a;
    return n;
  }
};

}  // namespace capserve::runtime
