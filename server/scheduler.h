#pragma once
// Continuous batching on rank 0 (server/README.md): requests wait in a queue, join the running batch when
// there is room (sequence slots, batched tokens, KV blocks on some rank) in the order the CAPS batch selector
// chooses, decode one token per step, and end on a stop token, a stop string, their token budget, the context
// length, cancellation or their deadline. Each sequence runs on the data-parallel rank with the most room.
// The scheduler turns this state into one StepPlan per step and the ranks' StepResults back into client
// events.
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "parallel/moe_stats.h"
#include "runtime/load_predictor.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/batch_selector.h"
#include "server/output_stream.h"
#include "server/request.h"
#include "server/server_metrics.h"
#include "server/step_plan.h"

namespace capserve::server {

struct SchedulerConfig {
  std::int64_t max_running = 64;           // sequences decoding at once, all ranks together
  std::int64_t max_batched_tokens = 2048;  // tokens per step, all ranks together
  std::int64_t max_queue = 512;            // waiting requests beyond this are refused (RESOURCE_EXHAUSTED)
  std::int64_t kv_blocks_per_rank = 1024;
  std::int64_t kv_block_size = 16;
  std::int64_t max_context = 4096;         // prompt + generated tokens
  std::int64_t assignments_per_token = 0;  // top_k * MoE layers, for the per-request statistics
  std::int64_t dry_run_layers = 1;         // MoE layers the predictor and the realized load cover
  // Speculative decoding: the most drafts a decode verifies per step (--num-speculative-tokens; 0: off).
  std::int64_t speculative_tokens = 0;
  bool prefix_cache = false;  // --prefix-cache
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

  // Handler threads. Empty on success, else why the request is refused now (queue full: RESOURCE_EXHAUSTED;
  // draining: UNAVAILABLE; never_fits: INVALID_ARGUMENT, see why_never_fits) — the handler reports it;
  // nothing is queued.
  enum class Refusal { none, queue_full, draining, never_fits };
  Refusal submit(std::shared_ptr<Request> request);
  // Empty when the request fits an idle server, else which limit it exceeds: a prompt longer than the batched
  // tokens of a step (prompts are prefilled whole), or prompt + max tokens needing more KV blocks than a rank
  // has. Such a request would wait forever at the head of the queue.
  [[nodiscard]] std::string why_never_fits(const Request& request) const;
  // Empty when a prompt of `tokens` tokens fits the batched tokens of one step, else why not (after the field
  // that holds the prompt: "N tokens exceed ...").
  [[nodiscard]] std::string why_prompt_too_long(std::int64_t tokens) const;
  // Stop admitting; running and waiting requests still finish.
  void drain();
  // After drain(), or once `stop_requested` reads true.
  [[nodiscard]] bool draining() const;
  // Wakes the engine loop when there is something to do (or `timeout` passes).
  void wait_for_work(std::chrono::milliseconds timeout);

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
    std::vector<float> load;  // predicted, per rank
    bool predicted = false;
  };
  struct Running {
    std::shared_ptr<Request> request;
    std::int32_t rank = 0;
    std::int64_t blocks = 0;  // reserved for prompt + max tokens
    std::int64_t completion = 0;
    std::int64_t dropped = 0, rerouted = 0;
    std::int64_t drafted = 0, accepted = 0;  // speculative decoding's drafts verified and kept
    OutputStream stream;
    Clock::time_point last_token{};
    // Log-probability entries not yet sent: the prompt's, and the sampled tokens', each with the stream's
    // text_bytes() after its token (its entry goes with the event whose text completes it).
    LogprobEntries prompt_logprobs{}, logprobs{};
    std::deque<std::size_t> logprob_text_ends{};
    Clock::time_point admitted{};
    Clock::time_point first_token{};  // when completion > 0
  };
  // A sampled token's log-probability record and its alternatives, when its sequence asks.
  struct Scored {
    const LogprobRecord* record = nullptr;
    std::span<const TopLogprob> top;
  };

  // KV blocks reserved for the request: prompt + max tokens, within the context length.
  [[nodiscard]] std::int64_t kv_blocks_needed(const Request& request) const;
  void admit(Clock::time_point now, StepPlan& plan);
  // The plan's max_drafts: each decode's room within its max_tokens and the context, from the batched tokens
  // the decodes and the admitted prompts leave.
  void plan_drafts(StepPlan& plan) const;
  void finish(std::uint64_t id, Running& run, Terminal terminal, const std::string& message,
              Clock::time_point now);
  void emit_token(std::uint64_t id, Running& run, std::int32_t token, const Scored& scored,
                  Clock::time_point now);
  // Moves the request's pending log-probability entries whose text has been sent (all of them at the end)
  // into the event about to be sent.
  static void take_logprobs(Running& run, bool all, RequestEvent& e);
  void end_waiting(Waiting& w, Terminal terminal, const std::string& message, Clock::time_point now);

  SchedulerConfig config_;
  int ranks_;
  const runtime::Tokenizer* tokenizer_;
  runtime::LoadPredictor* predictor_;
  ServerMetrics* metrics_;
  BatchSelector selector_;

  mutable std::mutex inbox_mutex_;
  std::condition_variable inbox_ready_;
  std::vector<std::shared_ptr<Request>> inbox_;
  std::int64_t queued_ = 0;  // inbox + waiting, guarded by inbox_mutex_
  bool draining_ = false;
  const std::atomic<bool>* stop_requested_;

  std::deque<Waiting> waiting_;
  std::unordered_map<std::uint64_t, Running> running_;
  std::vector<std::uint64_t> to_free_;
  std::vector<std::int64_t> rank_blocks_used_;
  std::vector<std::int64_t> rank_sequences_;
  std::vector<std::pair<std::uint64_t, std::int32_t>> in_step_;  // (sequence, rank) of the last plan
  std::uint64_t next_id_ = 1;
  std::vector<float> running_load_;  // per rank: the decode batch's realized load, from the last step
  std::vector<float> predicted_step_load_;
  std::int64_t last_step_tokens_ = 0;
  // Per step, reused.
  std::vector<Candidate> candidates_;
  std::vector<Scored> scored_;  // a result's sampled-token records of one sequence
};

}  // namespace capserve::server
