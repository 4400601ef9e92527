#pragma once
// Continuous batching on rank 0 (server/README.md): admission, placement and KV accounting. Requests wait in
// a queue and join the running batch when there is room (sequence slots, the step's token budget, KV blocks
// on some rank) in the order the CAPS batch selector chooses. Each step spends one token budget: every
// running decode first (a decode never waits behind a long prompt), then the prompts being prefilled, in
// chunks, oldest first, then newcomers. A newcomer goes to the data-parallel rank whose prefix cache holds
// most of its prompt, unless that rank is busier than the least busy one by more than a slack. The scheduler
// turns this state into one StepPlan per step, reads the ranks' StepResults into typed sequence outputs, and
// hands those to its OutputProcessor, which tells it which requests ended.
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "parallel/moe_stats.h"
#include "runtime/load_predictor.h"
#include "runtime/status.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/batch_selector.h"
#include "server/kv_ledger.h"
#include "server/output_processor.h"
#include "server/rank_choice.h"
#include "server/request.h"
#include "server/request_limits.h"
#include "server/request_queue.h"
#include "server/server_metrics.h"
#include "server/step_load.h"
#include "server/step_plan.h"

namespace capserve::server {

struct SchedulerConfig {
  std::int64_t max_running = 64;           // sequences running at once (prefilling or decoding), all ranks
  std::int64_t max_batched_tokens = 2048;  // tokens per step, all ranks together: decodes and prefill chunks
  std::int64_t max_queue = 512;            // waiting requests beyond this are refused (RESOURCE_EXHAUSTED)
  std::int64_t kv_blocks_per_rank = 1024;
  std::int64_t kv_block_size = 16;
  std::int64_t max_context = 4096;         // prompt + generated tokens
  std::int64_t assignments_per_token = 0;  // top_k * MoE layers, for the per-request statistics
  // Speculative decoding: the most drafts a decode verifies per step (--num-speculative-tokens; 0: off).
  std::int64_t speculative_tokens = 0;
  // Prompts longer than this are prefilled whole, in one step (so at most max_batched_tokens long): a model
  // with dynamic NTK rope turns keys with frequencies that depend on the sequence's length past its
  // max_position_embeddings, so chunks would change them (0: every prompt may be chunked).
  std::int64_t whole_prefill_above = 0;
  // Full KV blocks stay cached by content after their sequence ends, and a prompt starts after its longest
  // cached prefix (--prefix-cache).
  bool prefix_cache = false;
  // A newcomer may go to the rank holding its longest cached prefix while that rank runs at most this many
  // more sequences than the least busy rank with room; beyond, the least busy rank takes it.
  std::int64_t cache_affinity_slack = 4;
  // ... and while that prefix covers at least this share of its prompt (rank_choice.h).
  double cache_affinity_min_share = 0.5;
  SelectorConfig selector;
};

class Scheduler {
 public:
  // `stop_requested` (optional) is the stop signal's flag: once it reads true the scheduler admits nothing,
  // as after drain(), so that no request is accepted after the signal, even before the engine loop calls
  // drain().
  // `predictor` (optional, outliving the scheduler) predicts each waiting request's per-rank load for the
  // batch selector.
  Scheduler(SchedulerConfig config, int ranks, const runtime::Tokenizer* tokenizer,
            runtime::LoadPredictor* predictor, ServerMetrics* metrics,
            const std::atomic<bool>* stop_requested = nullptr);

  // Handler threads. OK when queued, else why the request is refused now (the handler reports it; nothing
  // is queued): RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (draining), INVALID_ARGUMENT (it never fits,
  // RequestLimits::check_fits, naming the field).
  runtime::Status submit(std::shared_ptr<Request> request);
  // The limits every request is checked against (check_fits at submission).
  [[nodiscard]] const RequestLimits& limits() const { return limits_; }
  // Stop admitting; running and waiting requests still finish.
  void drain() { queue_.drain(); }
  // After drain(), or once `stop_requested` reads true.
  [[nodiscard]] bool draining() const { return queue_.draining(); }
  // Wakes the engine loop when there is something to do (or `timeout` passes).
  void wait_for_work(std::chrono::milliseconds timeout) { queue_.wait_for_work(timeout); }

  // Engine loop.
  StepPlan plan(Clock::time_point now);
  void complete(std::span<const StepResult> results, const parallel::MoeStepStats& stats,
                Clock::time_point now);
  // Nothing running, waiting or to free.
  [[nodiscard]] bool idle() const;
  // Ends every request with `terminal` (e.g. on shutdown after a fatal error).
  void fail_all(Terminal terminal, const std::string& message);

 private:
  struct Waiting {
    std::shared_ptr<Request> request;
    std::vector<float> load;  // predicted for the whole prompt, per rank
    bool predicted = false;
  };
  struct Running {
    std::shared_ptr<Request> request;
    std::int32_t rank = 0;
    std::int64_t prompt_done = 0;  // prompt tokens in its cache once the planned steps ran
    std::int64_t length = 0;       // tokens in its cache once the planned steps ran
    std::int32_t next = 0;         // the sampled token its next decode feeds
    bool decoding = false;         // its prompt is in and a token was sampled
    std::vector<float> load;       // predicted for the whole prompt, per rank
  };
  // One prefill chunk or decode of the last plan, in the ranks' work order.
  struct Item {
    std::uint64_t id = 0;
    std::int32_t rank = 0;
    std::int64_t chunk = 0;  // prompt tokens computed; 0: a decode
  };

  void expire(Clock::time_point now);
  // Spends `budget` on the prompts being prefilled, oldest first; returns what is left.
  std::int64_t plan_chunks(StepPlan& plan, std::int64_t budget);
  // Admits waiting requests with their first chunks from what is left of `budget`; returns what remains.
  std::int64_t admit(Clock::time_point now, StepPlan& plan, std::int64_t budget);
  // The plan's max_drafts: each decode's room within its max_tokens and the context, from the batched tokens
  // the decodes and the prefill chunks leave.
  void plan_drafts(StepPlan& plan, std::int64_t budget) const;
  // Reserves the decodes' blocks and records every planned token in the ledger, in the ranks' order.
  void settle_kv(const StepPlan& plan);
  // The sequence's request ended: its blocks are freed at the next step.
  void release(std::uint64_t id);
  void publish_metrics();

  SchedulerConfig config_;
  int ranks_;
  runtime::LoadPredictor* predictor_;
  ServerMetrics* metrics_;
  BatchSelector selector_;
  OutputProcessor outputs_;
  KvLedger kv_;
  StepLoad load_;
  RequestLimits limits_;

  RequestQueue queue_;

  std::deque<Waiting> waiting_;
  std::unordered_map<std::uint64_t, Running> running_;
  std::vector<std::uint64_t> to_free_;
  std::vector<std::int64_t> rank_sequences_;
  std::vector<Item> in_step_;
  std::uint64_t next_id_ = 1;
  std::int64_t last_evictions_ = 0;  // the ledger's count at the last metrics update
  // Per step, reused.
  std::vector<Candidate> candidates_;
  std::vector<std::vector<float>> chunk_loads_;  // [candidate]: its predicted load of this step's chunk
  std::vector<std::uint64_t> prefilling_;
  std::vector<std::uint64_t> failed_;  // a refused step's sequences on one rank
  std::vector<std::size_t> taken_;     // waiting_ indices admitted this step
};

}  // namespace capserve::server
