#include "server/output_processor.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <utility>

#include "server/logging.h"

namespace capserve::server {
namespace {

// A sequence that could not draw its next token (completion token `at`): the request's own doing (its
// controls rule out every token) or the server's.
Terminal failure_terminal(SequenceFailure failure) {
  return failure == SequenceFailure::no_allowed_token ? Terminal::invalid_argument : Terminal::internal;
}

std::string failure_message(SequenceFailure failure, std::int64_t at) {
  const std::string token = "completion token " + std::to_string(at);
  switch (failure) {
    case SequenceFailure::no_allowed_token:
      return "the request's sampling controls (allowed tokens, min_tokens, logit_bias) rule out every token "
             "at " +
             token;
    case SequenceFailure::constraint:
      return "the server could not apply the request's output constraint at " + token +
             " (its rank's log says why)";
    case SequenceFailure::non_finite_logits:
    case SequenceFailure::none:
      break;
  }
  return "the model's logits for this request are not finite (NaN or infinity) at " + token +
         "; no token can be sampled";
}

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

OutputProcessor::OutputProcessor(const runtime::Tokenizer* tokenizer, ServerMetrics* metrics,
                                 OutputOptions options)
    : tokenizer_(tokenizer), metrics_(metrics), options_(options) {}

void OutputProcessor::open(std::uint64_t id, std::shared_ptr<Request> request, std::int64_t cached_tokens,
                           Clock::time_point now) {
  const OutputForm& form = request->output();
  OutputStream stream(form.text ? tokenizer_ : nullptr, form.stop_strings, form.skip_special_tokens);
  if (metrics_ != nullptr) {
    metrics_->observe_queue_time(seconds(now - request->arrival()));
    metrics_->add_prompt_tokens(static_cast<std::int64_t>(request->prompt().size()));
  }
  outputs_.insert_or_assign(id, Output{.request = std::move(request),
                                       .stream = std::move(stream),
                                       .cached_tokens = cached_tokens,
                                       .admitted = now});
}

bool OutputProcessor::consume(const SequenceOutput& out, Clock::time_point now) {
  const auto it = outputs_.find(out.id);
  if (it == outputs_.end()) return false;
  Output& o = it->second;
  scored_.clear();
  std::size_t top = 0;
  for (const LogprobRecord& rec : out.records) {
    const auto count = static_cast<std::size_t>(std::max(0, rec.top_count));
    const std::span<const TopLogprob> alternatives = out.top.subspan(top, count);
    top += count;
    if (rec.prompt != 0) {
      o.prompt_logprobs.append(rec.token, rec.logprob, alternatives);
    } else {
      scored_.push_back({&rec, alternatives});
    }
  }
  const SequenceResult& s = *out.result;
  o.prefill_chunks += out.prefill ? 1 : 0;
  o.dropped += s.dropped;
  o.rerouted += s.rerouted;
  o.drafted += s.drafted;
  o.accepted += s.accepted;
  if (metrics_ != nullptr && s.drafted > 0) metrics_->record_speculation(s.drafted, s.accepted);
  // The kept tokens in order, each as a lone token would be: the first that ends the request (stop token,
  // stop string, max_tokens, context) discards the ones after it.
  for (std::size_t k = 0; k < out.tokens.size(); ++k) {
    if (emit_token(o, out.tokens[k], k < scored_.size() ? scored_[k] : Scored{}, now)) {
      outputs_.erase(it);
      return true;
    }
  }
  if (s.failure != SequenceFailure::none) {
    finish(o, failure_terminal(s.failure), failure_message(s.failure, o.completion + 1), now);
    outputs_.erase(it);
    return true;
  }
  return false;
}

void OutputProcessor::close(std::uint64_t id, Terminal terminal, const std::string& message,
                            Clock::time_point now) {
  const auto it = outputs_.find(id);
  if (it == outputs_.end()) return;
  finish(it->second, terminal, message, now);
  outputs_.erase(it);
}

bool OutputProcessor::emit_token(Output& o, std::int32_t token, const Scored& scored, Clock::time_point now) {
  const Request& req = *o.request;
  ++o.completion;
  if (metrics_ != nullptr) {
    metrics_->add_generation_tokens(1);
    if (o.completion == 1) {
      metrics_->observe_time_to_first_token(seconds(now - req.arrival()));
    } else {
      metrics_->observe_inter_token_latency(seconds(now - o.last_token));
    }
  }
  if (o.completion == 1) o.first_token = now;
  o.last_token = now;
  const runtime::SamplingParams& p = req.params();
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end()) {
    finish(o, Terminal::ok_stop, "", now);
    return true;
  }
  OutputStream::Chunk chunk = o.stream.feed(token);
  if (chunk.stop) {
    finish(o, Terminal::ok_stop, "", now);
    return true;
  }
  // The token's entry goes with the event that carries it: its own (token output) or the next text delta,
  // since text held back for a stop string covers tokens already fed.
  if (scored.record != nullptr) {
    o.logprobs.append(token, scored.record->logprob, scored.top);
    o.logprob_text_ends.push_back(o.stream.text_bytes());
  }
  RequestEvent e;
  e.text = std::move(chunk.text);
  if (chunk.token) e.tokens.push_back(*chunk.token);
  if (!e.text.empty() || !e.tokens.empty()) {
    take_logprobs(o, false, e);
    o.request->push(std::move(e));
  }
  const auto length = static_cast<std::int64_t>(req.prompt().size()) + o.completion;
  if (o.completion >= p.max_new_tokens || length >= options_.max_context) {
    finish(o, Terminal::ok_length, "", now);
    return true;
  }
  return false;
}

void OutputProcessor::finish(Output& o, Terminal terminal, const std::string& message,
                             Clock::time_point now) {
  RequestEvent e;
  // Text held back for a stop string that never came is sent at a normal end.
  if (terminal == Terminal::ok_length || terminal == Terminal::ok_stop) e.text = o.stream.finish();
  e.terminal = terminal;
  e.message = message;
  take_logprobs(o, true, e);
  const Request& r = *o.request;
  const auto prompt = static_cast<std::int64_t>(r.prompt().size());
  e.prompt_tokens = static_cast<std::uint32_t>(prompt);
  e.completion_tokens = static_cast<std::uint32_t>(o.completion);
  e.cached_tokens = static_cast<std::uint32_t>(o.cached_tokens);
  // Computed tokens: the prompt but what the prefix cache served, each later token, and the drafts the
  // verification rejected.
  e.moe_assignments = static_cast<std::uint64_t>(
      (prompt - o.cached_tokens + std::max<std::int64_t>(0, o.completion - 1) + o.drafted - o.accepted) *
      options_.assignments_per_token);
  e.moe_dropped = static_cast<std::uint64_t>(o.dropped);
  e.moe_rerouted = static_cast<std::uint64_t>(o.rerouted);
  const double e2e = seconds(now - r.arrival());
  std::optional<double> ttft;
  if (o.completion > 0) ttft = seconds(o.first_token - r.arrival());
  if (metrics_ != nullptr) {
    metrics_->observe_end_to_end_latency(e2e);
    metrics_->observe_request_lengths(prompt, o.completion);
    if (o.prefill_chunks > 1) metrics_->count_chunked_prefill();
    metrics_->record_capacity_class(r.params().protect, o.dropped, o.rerouted);
    if (o.completion > 0) {
      metrics_->observe_prefill_time(seconds(o.first_token - o.admitted));
      metrics_->observe_decode_time(seconds(now - o.first_token));
    }
  }
  const bool speculative = options_.speculative;
  log_access({.request_id = r.id(),
              .peer = r.peer(),
              .prompt_tokens = prompt,
              .completion_tokens = o.completion,
              .finish_reason = finish_reason(terminal),
              .queue_s = seconds(o.admitted - r.arrival()),
              .ttft_s = ttft,
              .e2e_s = e2e,
              .dropped = o.dropped,
              .rerouted = o.rerouted,
              .drafted = speculative ? std::optional<std::int64_t>(o.drafted) : std::nullopt,
              .accepted = speculative ? std::optional<std::int64_t>(o.accepted) : std::nullopt,
              .cached_tokens = o.cached_tokens,
              .prefill_chunks = o.prefill_chunks});
  o.request->push(std::move(e));
}

void OutputProcessor::refused(const Request& request, runtime::StatusCode code) const {
  std::string reason = runtime::code_name(code);
  std::transform(reason.begin(), reason.end(), reason.begin(),
                 [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); });
  log_unadmitted(request, reason, std::nullopt, seconds(Clock::now() - request.arrival()));
}

void OutputProcessor::end_waiting(Request& request, Terminal terminal, const std::string& message,
                                  Clock::time_point now) const {
  // It spent its whole life in the queue.
  const double waited = seconds(now - request.arrival());
  log_unadmitted(request, finish_reason(terminal), waited, waited);
  RequestEvent e;
  e.terminal = terminal;
  e.prompt_tokens = static_cast<std::uint32_t>(request.prompt().size());
  e.message = message;
  request.push(std::move(e));
}

// No tokens, no MoE work, no drafts (named when the server speculates, as on every line).
void OutputProcessor::log_unadmitted(const Request& request, std::string_view reason,
                                     std::optional<double> queue_s, double e2e_s) const {
  const bool speculative = options_.speculative;
  log_access({.request_id = request.id(),
              .peer = request.peer(),
              .prompt_tokens = static_cast<std::int64_t>(request.prompt().size()),
              .completion_tokens = 0,
              .finish_reason = reason,
              .queue_s = queue_s,
              .ttft_s = std::nullopt,
              .e2e_s = e2e_s,
              .dropped = 0,
              .rerouted = 0,
              .drafted = speculative ? std::optional<std::int64_t>(0) : std::nullopt,
              .accepted = speculative ? std::optional<std::int64_t>(0) : std::nullopt});
}

void OutputProcessor::take_logprobs(Output& o, bool all, RequestEvent& e) {
  if (!o.prompt_logprobs.empty()) e.prompt_logprobs = std::exchange(o.prompt_logprobs, {});
  std::size_t sent = 0;
  while (!o.logprob_text_ends.empty() && (all || o.logprob_text_ends.front() <= o.stream.sent_bytes())) {
    o.logprob_text_ends.pop_front();
    ++sent;
  }
  o.logprobs.move_front(sent, e.logprobs);
}

}  // namespace capserve::server
