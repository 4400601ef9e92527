#pragma once
// Router-assisted batch selection (CAPS, server/README.md): which waiting requests join the running batch
// this step, chosen so that the batch's aggregate expert load — the running sequences' real loads plus the
// newcomers' predicted ones — is as even as possible over the balance dimensions (ranks by default, since the
// straggler is a device). A pure function of its inputs (and a seeded generator for the sampling strategies);
// its decision time is what bench_batch_selector measures.
#include <chrono>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace capserve::server {

enum class SelectionStrategy { fcfs, greedy, power_of_d, lpt_balanced, random };

struct SelectorConfig {
  SelectionStrategy strategy = SelectionStrategy::fcfs;
  std::int64_t window = 256;         // only the oldest `window` waiting requests are candidates
  std::int64_t min_queue_depth = 4;  // with fewer waiting requests, admit first come first served
  std::int64_t power_of_d = 4;       // candidates sampled per admission by power_of_d
  double max_wait_ms = 2000;         // a request older than this is admitted before any selection
  double interval_ms = 0;            // run the selector at most this often; FCFS in between
  std::uint64_t seed = 0;
};

// One waiting request, as the scheduler sees it.
struct Candidate {
  std::int64_t tokens = 0;      // prompt tokens this admission processes
  std::int64_t kv_blocks = 0;   // cache blocks it needs
  double waited_ms = 0;         // time since arrival
  std::span<const float> load;  // predicted load per balance dimension (e.g. per rank)
};

// What a step can still take.
struct AdmissionBudget {
  std::int64_t sequences = 0;  // free sequence slots
  std::int64_t tokens = 0;     // batched-token budget left
  std::int64_t kv_blocks = 0;  // free KV blocks
};

struct Selection {
  std::vector<std::int64_t> admitted;  // indices into the candidate list, in admission order
  bool selected = false;             // false: plain FCFS (below min depth, between intervals, strategy fcfs)
  double predicted_imbalance = 1.0;  // max/mean of the aggregate load after admission
};

class BatchSelector {
 public:
  BatchSelector(SelectorConfig config, std::int64_t dims);

  [[nodiscard]] const SelectorConfig& config() const { return config_; }

  // candidates are ordered oldest first. running: the running sequences' aggregate load from the last step.
  // now: for the interval. Every admitted request fits the budget, and the oldest request past max_wait_ms is
  // always admitted first if it fits at all.
  Selection select(std::span<const Candidate> candidates, std::span<const float> running,
                   const AdmissionBudget& budget, std::chrono::steady_clock::time_point now);

 private:
  bool fits(const Candidate& c) const;
  void take(std::span<const Candidate> candidates, std::int64_t index, Selection& out);
  void score_window(std::int64_t width);
  void admit_fcfs(std::span<const Candidate> candidates, std::int64_t from, Selection& out);
  void search_exactly(std::span<const Candidate> candidates, std::int64_t first, std::int64_t end,
                      std::int64_t count, const AdmissionBudget& budget, Selection& out);

  SelectorConfig config_;
  std::int64_t dims_;
  std::mt19937_64 rng_;
  std::chrono::steady_clock::time_point last_selection_{};
  // Per call, reused.
  AdmissionBudget left_;
  std::vector<double> aggregate_;
  std::vector<double> start_aggregate_;  // before this selection's picks
  std::vector<double> trial_;
  double aggregate_sum_ = 0;
  double aggregate_sq_ = 0;
  std::vector<std::uint8_t> taken_;
  std::vector<std::int64_t> pool_;       // positions in alive_ to score
  std::vector<std::int64_t> alive_;      // window indices not yet taken, oldest first
  std::vector<double> packed_;           // [dims, window] loads
  std::vector<double> scores_;           // [window]
  std::vector<double> self_sq_, total_;  // per window candidate: sum of squares, sum
};

std::string to_string(SelectionStrategy s);
bool parse_strategy(const std::string& text, SelectionStrategy& out);

// max / mean of a load vector (1 for an all-zero vector).
double imbalance(std::span<const double> load);

}  // namespace capserve::server
