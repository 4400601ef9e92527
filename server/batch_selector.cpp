#include "server/batch_selector.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace capserve::server {

std::string to_string(SelectionStrategy s) {
  switch (s) {
    case SelectionStrategy::fcfs:
      return "fcfs";
    case SelectionStrategy::greedy:
      return "greedy";
    case SelectionStrategy::power_of_d:
      return "power_of_d";
    case SelectionStrategy::lpt_balanced:
      return "lpt_balanced";
    case SelectionStrategy::random:
      return "random";
  }
  return "?";
}

bool parse_strategy(const std::string& text, SelectionStrategy& out) {
  for (const SelectionStrategy s :
       {SelectionStrategy::fcfs, SelectionStrategy::greedy, SelectionStrategy::power_of_d,
        SelectionStrategy::lpt_balanced, SelectionStrategy::random}) {
    if (text == to_string(s)) {
      out = s;
      return true;
    }
  }
  return false;
}

double imbalance(std::span<const double> load) {
  if (load.empty()) return 1.0;
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  if (total <= 0) return 1.0;
  return *std::max_element(load.begin(), load.end()) * static_cast<double>(load.size()) / total;
}

BatchSelector::BatchSelector(SelectorConfig config, std::int64_t dims)
    : config_(config), dims_(dims), rng_(config.seed), aggregate_(static_cast<std::size_t>(dims)) {}

bool BatchSelector::fits(const Candidate& c) const {
  return left_.sequences >= 1 && c.tokens <= left_.tokens && c.kv_blocks <= left_.kv_blocks;
}

void BatchSelector::take(std::span<const Candidate> candidates, std::int64_t index, Selection& out) {
  const Candidate& c = candidates[static_cast<std::size_t>(index)];
  left_.sequences -= 1;
  left_.tokens -= c.tokens;
  left_.kv_blocks -= c.kv_blocks;
  for (std::int64_t d = 0; d < dims_; ++d) {
    const auto i = static_cast<std::size_t>(d);
    const double before = aggregate_[i];
    aggregate_[i] += c.load[i];
    aggregate_sum_ += c.load[i];
    aggregate_sq_ += aggregate_[i] * aggregate_[i] - before * before;
  }
  taken_[static_cast<std::size_t>(index)] = 1;
  out.admitted.push_back(index);
}

// The objective after adding each window candidate (lower is better), for all of them at once over the
// transposed loads so the loops vectorize: n * the sum of squared deviations from the mean (the variance
// objective) from the running sums in O(dims) per candidate; for lpt_balanced the resulting maximum.
void BatchSelector::score_window(std::int64_t width) {
  scores_.assign(static_cast<std::size_t>(width), 0.0);
  double* score = scores_.data();
  if (config_.strategy == SelectionStrategy::lpt_balanced) {
    for (std::int64_t d = 0; d < dims_; ++d) {
      const double a = aggregate_[static_cast<std::size_t>(d)];
      const double* v = packed_.data() + d * width;
      for (std::int64_t i = 0; i < width; ++i) score[i] = std::max(score[i], a + v[i]);
    }
    return;
  }
  for (std::int64_t d = 0; d < dims_; ++d) {
    const double a = aggregate_[static_cast<std::size_t>(d)];
    const double* v = packed_.data() + d * width;
    for (std::int64_t i = 0; i < width; ++i) score[i] += a * v[i];
  }
  const auto n = static_cast<double>(dims_);
  for (std::int64_t i = 0; i < width; ++i) {
    const double sum = aggregate_sum_ + total_[static_cast<std::size_t>(i)];
    score[i] = n * (aggregate_sq_ + 2 * score[i] + self_sq_[static_cast<std::size_t>(i)]) - sum * sum;
  }
}

void BatchSelector::admit_fcfs(std::span<const Candidate> candidates, std::int64_t from, Selection& out) {
  for (auto i = from; i < static_cast<std::int64_t>(candidates.size()); ++i) {
    if (taken_[static_cast<std::size_t>(i)] != 0) continue;
    if (!fits(candidates[static_cast<std::size_t>(i)])) break;  // strict order: nobody overtakes the head
    take(candidates, i, out);
  }
}

Selection BatchSelector::select(std::span<const Candidate> candidates, std::span<const float> running,
                                const AdmissionBudget& budget, std::chrono::steady_clock::time_point now) {
  Selection out;
  const auto n = static_cast<std::int64_t>(candidates.size());
  left_ = budget;
  taken_.assign(static_cast<std::size_t>(n), 0);
  aggregate_sum_ = 0;
  aggregate_sq_ = 0;
  for (std::int64_t d = 0; d < dims_; ++d) {
    const auto i = static_cast<std::size_t>(d);
    aggregate_[i] = running.empty() ? 0.0 : running[i];
    aggregate_sum_ += aggregate_[i];
    aggregate_sq_ += aggregate_[i] * aggregate_[i];
  }

  // Anti-starvation: overdue requests go first, oldest first; one that does not fit stops all admission, so
  // that nothing younger overtakes it while it waits for room.
  std::int64_t overdue = 0;
  for (; overdue < n && candidates[static_cast<std::size_t>(overdue)].waited_ms >= config_.max_wait_ms;
       ++overdue) {
    if (!fits(candidates[static_cast<std::size_t>(overdue)])) {
      out.predicted_imbalance = imbalance(aggregate_);
      return out;
    }
    take(candidates, overdue, out);
  }

  const bool interval_due =
      config_.interval_ms <= 0 ||
      std::chrono::duration<double, std::milli>(now - last_selection_).count() >= config_.interval_ms;
  const bool use_fcfs =
      config_.strategy == SelectionStrategy::fcfs || n - overdue < config_.min_queue_depth || !interval_due;
  if (use_fcfs) {
    admit_fcfs(candidates, overdue, out);
    out.predicted_imbalance = imbalance(aggregate_);
    return out;
  }
  out.selected = true;
  last_selection_ = now;
  const std::int64_t end = std::min(n, overdue + config_.window);
  const AdmissionBudget start_budget = left_;
  start_aggregate_ = aggregate_;
  // The window's loads, transposed, with their sums.
  const std::int64_t width = end - overdue;
  packed_.resize(static_cast<std::size_t>(width * dims_));
  self_sq_.resize(static_cast<std::size_t>(width));
  total_.resize(static_cast<std::size_t>(width));
  alive_.clear();
  for (std::int64_t i = 0; i < width; ++i) {
    const Candidate& c = candidates[static_cast<std::size_t>(overdue + i)];
    double sq = 0;
    double sum = 0;
    for (std::int64_t d = 0; d < dims_; ++d) {
      const double v = c.load[static_cast<std::size_t>(d)];
      packed_[static_cast<std::size_t>(d * width + i)] = v;
      sq += v * v;
      sum += v;
    }
    self_sq_[static_cast<std::size_t>(i)] = sq;
    total_[static_cast<std::size_t>(i)] = sum;
    alive_.push_back(i);
  }
  while (left_.sequences > 0) {
    // Budgets only shrink: a candidate that no longer fits never will this step.
    std::erase_if(alive_,
                  [&](std::int64_t i) { return !fits(candidates[static_cast<std::size_t>(overdue + i)]); });
    if (alive_.empty()) break;
    std::size_t pick = 0;  // position in alive_ (age order: ties go to the older request)
    if (config_.strategy == SelectionStrategy::random) {
      pick = std::uniform_int_distribution<std::size_t>(0, alive_.size() - 1)(rng_);
    } else {
      score_window(width);
      pool_.clear();
      if (config_.strategy == SelectionStrategy::power_of_d &&
          static_cast<std::int64_t>(alive_.size()) > config_.power_of_d) {
        // d distinct positions; the oldest is always among them.
        pool_.push_back(0);
        while (static_cast<std::int64_t>(pool_.size()) < config_.power_of_d) {
          const auto k = static_cast<std::int64_t>(
              std::uniform_int_distribution<std::size_t>(1, alive_.size() - 1)(rng_));
          if (std::find(pool_.begin(), pool_.end(), k) == pool_.end()) pool_.push_back(k);
        }
        std::sort(pool_.begin(), pool_.end());
      } else {
        pool_.resize(alive_.size());
        std::iota(pool_.begin(), pool_.end(), 0);
      }
      // lpt_balanced breaks ties towards the larger request (longest processing time first).
      const bool lpt = config_.strategy == SelectionStrategy::lpt_balanced;
      double best = std::numeric_limits<double>::infinity();
      double best_size = -1;
      for (const std::int64_t p : pool_) {
        const std::int64_t i = alive_[static_cast<std::size_t>(p)];
        const double s = scores_[static_cast<std::size_t>(i)];
        const double size = lpt ? total_[static_cast<std::size_t>(i)] : 0.0;
        if (s < best || (s == best && size > best_size)) {
          best = s;
          best_size = size;
          pick = static_cast<std::size_t>(p);
        }
      }
    }
    take(candidates, overdue + alive_[pick], out);
    alive_.erase(alive_.begin() + static_cast<std::ptrdiff_t>(pick));
  }
  if (config_.strategy == SelectionStrategy::greedy) {
    search_exactly(candidates, overdue, end, static_cast<std::int64_t>(out.admitted.size()) - overdue,
                   start_budget, out);
  }
  out.predicted_imbalance = imbalance(aggregate_);
  return out;
}

// Greedy is not optimal in general (its first pick may be the most balanced request alone rather than one
// half of a perfect pair). Where the window is small enough, every subset of the same size is tried, so small
// cases get the exact optimum; the budget of 4096 subsets keeps the decision well under the 100 us target.
void BatchSelector::search_exactly(std::span<const Candidate> candidates, std::int64_t first,
                                   std::int64_t end, std::int64_t count, const AdmissionBudget& budget,
                                   Selection& out) {
  const std::int64_t n = end - first;
  if (count < 2 || n > 24 || count >= n) return;
  double subsets = 1;
  for (std::int64_t i = 0; i < count; ++i)
    subsets = subsets * static_cast<double>(n - i) / static_cast<double>(i + 1);
  if (subsets > 4096) return;
  const auto score_of = [&](std::uint32_t mask, bool& fits_budget) {
    std::int64_t tokens = 0;
    std::int64_t blocks = 0;
    std::copy(start_aggregate_.begin(), start_aggregate_.end(), trial_.begin());
    for (std::int64_t i = 0; i < n; ++i) {
      if ((mask >> i & 1U) == 0) continue;
      const Candidate& c = candidates[static_cast<std::size_t>(first + i)];
      tokens += c.tokens;
      blocks += c.kv_blocks;
      for (std::int64_t d = 0; d < dims_; ++d)
        trial_[static_cast<std::size_t>(d)] += c.load[static_cast<std::size_t>(d)];
    }
    fits_budget = tokens <= budget.tokens && blocks <= budget.kv_blocks;
    double sum = 0;
    double sq = 0;
    for (const double a : trial_) {
      sum += a;
      sq += a * a;
    }
    return static_cast<double>(dims_) * sq - sum * sum;
  };
  trial_.resize(static_cast<std::size_t>(dims_));
  std::uint32_t greedy_mask = 0;
  for (auto it = out.admitted.end() - count; it != out.admitted.end(); ++it)
    greedy_mask |= 1U << static_cast<unsigned>(*it - first);
  bool ok = true;
  double best = score_of(greedy_mask, ok);
  std::uint32_t best_mask = greedy_mask;
  // Gosper's hack: every n-bit mask with `count` bits set, in increasing order (older subsets first).
  for (std::uint32_t mask = (1U << count) - 1; mask < (1U << n);) {
    const double s = score_of(mask, ok);
    if (ok && s < best) {
      best = s;
      best_mask = mask;
    }
    const std::uint32_t low = mask & -mask;
    const std::uint32_t ripple = mask + low;
    mask = (((ripple ^ mask) >> 2) / low) | ripple;
  }
  if (best_mask == greedy_mask) return;
  out.admitted.resize(out.admitted.size() - static_cast<std::size_t>(count));
  left_ = budget;
  aggregate_ = start_aggregate_;
  aggregate_sum_ = std::accumulate(aggregate_.begin(), aggregate_.end(), 0.0);
  aggregate_sq_ = std::inner_product(aggregate_.begin(), aggregate_.end(), aggregate_.begin(), 0.0);
  std::fill(taken_.begin() + first, taken_.begin() + end, 0);
  for (std::int64_t i = 0; i < n; ++i) {
    if ((best_mask >> i & 1U) != 0) take(candidates, first + i, out);
  }
}

}  // namespace capserve::server
