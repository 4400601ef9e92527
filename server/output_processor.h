#pragma once
// What happens to a request's sampled tokens on rank 0, after the scheduler has placed them: incremental
// detokenizing and stop strings (OutputStream), the end conditions a token can meet (stop token, stop string,
// max_tokens, the context length), log-probability entries aligned with the text that completes their token,
// the request's events, its access line and its per-request metrics. The scheduler decides what runs; this
// decides what each result means to the client. One instance, on the step loop's thread.
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "runtime/status.h"
#include "runtime/tokenizer/tokenizer.h"
#include "server/logprob_entries.h"
#include "server/output_stream.h"
#include "server/request.h"
#include "server/sequence_output.h"
#include "server/server_metrics.h"
#include "server/step_plan.h"

namespace capserve::server {

struct OutputOptions {
  std::int64_t max_context = 4096;         // prompt + generated tokens
  std::int64_t assignments_per_token = 0;  // top_k * MoE layers, for the per-request statistics
  bool speculative = false;                // access lines name drafted / accepted counts
};

class OutputProcessor {
 public:
  OutputProcessor(const runtime::Tokenizer* tokenizer, ServerMetrics* metrics, OutputOptions options);

  // A request joins the batch as sequence `id`; `cached_tokens` of its prompt came from the prefix cache.
  void open(std::uint64_t id, std::shared_ptr<Request> request, std::int64_t cached_tokens,
            Clock::time_point now);
  // Applies a step's outcome for an open sequence; true when it ended its request (the sequence is closed).
  bool consume(const SequenceOutput& out, Clock::time_point now);
  // Ends an open sequence's request with `terminal` (cancellation, deadline, a rank's failure).
  void close(std::uint64_t id, Terminal terminal, const std::string& message, Clock::time_point now);
  [[nodiscard]] bool is_open(std::uint64_t id) const { return outputs_.contains(id); }
  // Tokens generated so far.
  [[nodiscard]] std::int64_t completion(std::uint64_t id) const { return outputs_.at(id).completion; }

  // A request the scheduler refused at submission (the front end answers it): its access line, named as its
  // status in lower case ("resource_exhausted", ...).
  void refused(const Request& request, runtime::StatusCode code) const;
  // A request that leaves the queue without having run: its terminal event and access line.
  void end_waiting(Request& request, Terminal terminal, const std::string& message,
                   Clock::time_point now) const;

 private:
  struct Output {
    std::shared_ptr<Request> request;
    OutputStream stream;
    std::int64_t cached_tokens = 0;
    std::int64_t prefill_chunks = 0;
    std::int64_t completion = 0;
    std::int64_t dropped = 0, rerouted = 0;
    std::int64_t drafted = 0, accepted = 0;  // speculative decoding's drafts verified and kept
    // Log-probability entries not yet sent: the prompt's, and the sampled tokens', each with the stream's
    // text_bytes() after its token (its entry goes with the event whose text completes it).
    LogprobEntries prompt_logprobs{}, logprobs{};
    std::deque<std::size_t> logprob_text_ends{};
    Clock::time_point admitted{};
    Clock::time_point first_token{};  // when completion > 0
    Clock::time_point last_token{};
  };
  // A sampled token's log-probability record and its alternatives, when its sequence asks.
  struct Scored {
    const LogprobRecord* record = nullptr;
    std::span<const TopLogprob> top;
  };

  void log_unadmitted(const Request& request, std::string_view reason, std::optional<double> queue_s,
                      double e2e_s) const;
  // Feeds one kept token; true when it ended the request.
  bool emit_token(Output& out, std::int32_t token, const Scored& scored, Clock::time_point now);
  void finish(Output& out, Terminal terminal, const std::string& message, Clock::time_point now);
  // Moves the request's pending log-probability entries whose text has been sent (all of them at the end)
  // into the event about to be sent.
  static void take_logprobs(Output& out, bool all, RequestEvent& e);

  const runtime::Tokenizer* tokenizer_;
  ServerMetrics* metrics_;
  OutputOptions options_;
  std::unordered_map<std::uint64_t, Output> outputs_;
  std::vector<Scored> scored_;  // a result's sampled-token records of one sequence, reused
};

}  // namespace capserve::server
