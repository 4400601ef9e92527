#include "server/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include "runtime/kv_block_manager.h"
#include "server/logging.h"

namespace capserve::server {
namespace {

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

double cosine(std::span<const float> a, std::span<const std::int64_t> b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    aa += static_cast<double>(a[i]) * static_cast<double>(a[i]);
    bb += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : std::numeric_limits<double>::quiet_NaN();
}

// The access line of a request that ends without having run: no tokens, no MoE work, no drafts (named when
// the server speculates, as on every line).
void log_unadmitted(const Request& r, std::string_view reason, std::optional<double> queue_s, double e2e_s,
                    bool speculative) {
  log_access({.request_id = r.id(),
              .peer = r.peer(),
              .prompt_tokens = static_cast<std::int64_t>(r.prompt().size()),
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

}  // namespace

Scheduler::Scheduler(SchedulerConfig config, int ranks, const runtime::Tokenizer* tokenizer,
                     runtime::LoadPredictor* predictor, ServerMetrics* metrics,
                     const std::atomic<bool>* stop_requested)
    : config_(config),
      ranks_(ranks),
      tokenizer_(tokenizer),
      predictor_(predictor),
      metrics_(metrics),
      selector_(config.selector, ranks),
      stop_requested_(stop_requested),
      rank_blocks_used_(static_cast<std::size_t>(ranks), 0),
      rank_sequences_(static_cast<std::size_t>(ranks), 0),
      running_load_(static_cast<std::size_t>(ranks), 0.0F),
      predicted_step_load_(static_cast<std::size_t>(ranks), 0.0F) {}

std::int64_t Scheduler::kv_blocks_needed(const Request& request) const {
  const auto prompt = static_cast<std::int64_t>(request.prompt().size());
  const std::int64_t total = std::min(config_.max_context, prompt + request.params().max_new_tokens);
  return runtime::KvBlockManager::blocks_for(total, config_.kv_block_size);
}

std::string Scheduler::why_never_fits(const Request& request) const {
  const auto prompt = static_cast<std::int64_t>(request.prompt().size());
  if (std::string why = why_prompt_too_long(prompt); !why.empty()) return "prompt: " + why;
  if (const std::int64_t blocks = kv_blocks_needed(request); blocks > config_.kv_blocks_per_rank)
    return "prompt + sampling.max_tokens: " + std::to_string(prompt + request.params().max_new_tokens) +
           " tokens need " + std::to_string(blocks) + " KV blocks of " +
           std::to_string(config_.kv_block_size) + " tokens, more than the " +
           std::to_string(config_.kv_blocks_per_rank) +
           " blocks of a rank (--kv-blocks); lower max_tokens or shorten the prompt";
  return {};
}

std::string Scheduler::why_prompt_too_long(std::int64_t tokens) const {
  if (tokens <= config_.max_batched_tokens) return {};
  return std::to_string(tokens) + " tokens exceed the " + std::to_string(config_.max_batched_tokens) +
         " batched tokens of a step (--max-batched-tokens); a prompt is prefilled in one step";
}

Scheduler::Refusal Scheduler::submit(std::shared_ptr<Request> request) {
  Refusal refusal = Refusal::none;
  if (!why_never_fits(*request).empty()) {
    refusal = Refusal::never_fits;
  } else {
    std::lock_guard lock(inbox_mutex_);
    if (draining_ || (stop_requested_ != nullptr && stop_requested_->load())) {
      refusal = Refusal::draining;
    } else if (queued_ >= config_.max_queue) {
      refusal = Refusal::queue_full;
    } else {
      ++queued_;
      inbox_.push_back(request);
    }
  }
  if (refusal == Refusal::none) {
    inbox_ready_.notify_one();
    return refusal;
  }
  // Refused requests end here, so the access log has their line too (named as their gRPC status).
  const Request& r = *request;
  log_unadmitted(r,
                 refusal == Refusal::never_fits ? "invalid_argument"
                 : refusal == Refusal::draining ? "unavailable"
                                                : "resource_exhausted",
                 std::nullopt, seconds(Clock::now() - r.arrival()), config_.speculative_tokens > 0);
  return refusal;
}

void Scheduler::drain() {
  {
    std::lock_guard lock(inbox_mutex_);
    draining_ = true;
  }
  inbox_ready_.notify_one();
}

bool Scheduler::draining() const {
  if (stop_requested_ != nullptr && stop_requested_->load()) return true;
  std::lock_guard lock(inbox_mutex_);
  return draining_;
}

void Scheduler::wait_for_work(std::chrono::milliseconds timeout) {
  std::unique_lock lock(inbox_mutex_);
  inbox_ready_.wait_for(lock, timeout, [&] { return !inbox_.empty() || draining_; });
}

bool Scheduler::idle() const {
  std::lock_guard lock(inbox_mutex_);
  return inbox_.empty() && waiting_.empty() && running_.empty() && to_free_.empty();
}

void Scheduler::end_waiting(Waiting& w, Terminal terminal, const std::string& message,
                            Clock::time_point now) {
  const Request& r = *w.request;
  // It spent its whole life in the queue.
  const double waited = seconds(now - r.arrival());
  log_unadmitted(r, finish_reason(terminal), waited, waited, config_.speculative_tokens > 0);
  RequestEvent e;
  e.terminal = terminal;
  e.prompt_tokens = static_cast<std::uint32_t>(r.prompt().size());
  e.message = message;
  w.request->push(std::move(e));
}

StepPlan Scheduler::plan(Clock::time_point now) {
  StepPlan plan;
  {
    std::lock_guard lock(inbox_mutex_);
    for (auto& r : inbox_) waiting_.push_back({std::move(r), {}, false});
    inbox_.clear();
  }
  // Cancellations and deadlines: waiting requests leave the queue, running ones are freed this step.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    // A passed deadline wins over cancellation: gRPC cancels the call at its deadline too.
    const bool expired = now >= it->request->deadline();
    if (expired || it->request->cancelled()) {
      if (expired) {
        end_waiting(*it, Terminal::deadline_exceeded, "deadline exceeded while waiting in the queue", now);
      } else {
        end_waiting(*it, Terminal::cancelled, "", now);
      }
      it = waiting_.erase(it);
      std::lock_guard lock(inbox_mutex_);
      --queued_;
    } else {
      ++it;
    }
  }
  std::vector<std::uint64_t> ended;
  for (auto& [id, run] : running_) {
    if (now >= run.request->deadline()) {
      finish(id, run, Terminal::deadline_exceeded, "deadline exceeded while generating", now);
      ended.push_back(id);
    } else if (run.request->cancelled()) {
      finish(id, run, Terminal::cancelled, "", now);
      ended.push_back(id);
    }
  }
  for (const std::uint64_t id : ended) running_.erase(id);

  plan.frees = std::move(to_free_);
  to_free_.clear();
  in_step_.clear();
  for (const auto& [id, run] : running_) {
    plan.decodes.push_back(id);
    in_step_.emplace_back(id, run.rank);
  }
  std::sort(plan.decodes.begin(), plan.decodes.end());
  admit(now, plan);
  plan_drafts(plan);
  if (metrics_ != nullptr) {
    metrics_->set_requests_running(static_cast<std::int64_t>(running_.size()));
    metrics_->set_requests_waiting(static_cast<std::int64_t>(waiting_.size()));
    metrics_->set_kv_cache_usage(rank_blocks_used_, config_.kv_blocks_per_rank);
  }
  return plan;
}

void Scheduler::admit(Clock::time_point now, StepPlan& plan) {
  if (waiting_.empty()) return;
  const auto window = static_cast<std::size_t>(
      std::min<std::int64_t>(config_.selector.window, static_cast<std::int64_t>(waiting_.size())));
  std::int64_t most_free = 0;
  for (int r = 0; r < ranks_; ++r)
    most_free =
        std::max(most_free, config_.kv_blocks_per_rank - rank_blocks_used_[static_cast<std::size_t>(r)]);
  candidates_.clear();
  for (std::size_t i = 0; i < window; ++i) {
    Waiting& w = waiting_[i];
    if (!w.predicted) {
      w.load.assign(static_cast<std::size_t>(ranks_), 0.0F);
      if (predictor_ != nullptr) predictor_->predict(w.request->prompt(), w.load);
      w.predicted = true;
    }
    const auto prompt = static_cast<std::int64_t>(w.request->prompt().size());
    candidates_.push_back({prompt, kv_blocks_needed(*w.request),
                           std::chrono::duration<double, std::milli>(now - w.request->arrival()).count(),
                           w.load});
  }
  const AdmissionBudget budget{config_.max_running - static_cast<std::int64_t>(running_.size()),
                               config_.max_batched_tokens - static_cast<std::int64_t>(plan.decodes.size()),
                               most_free};
  const auto started = Clock::now();
  const Selection selection = selector_.select(candidates_, running_load_, budget, now);
  if (metrics_ != nullptr && selection.selected)
    metrics_->observe_selector_decision(seconds(Clock::now() - started));

  std::fill(predicted_step_load_.begin(), predicted_step_load_.end(), 0.0F);
  for (int r = 0; r < ranks_; ++r)
    predicted_step_load_[static_cast<std::size_t>(r)] = running_load_[static_cast<std::size_t>(r)];
  std::vector<std::size_t> taken;
  for (const std::int64_t index : selection.admitted) {
    const auto i = static_cast<std::size_t>(index);
    const Candidate& c = candidates_[i];
    // The data-parallel rank with the fewest sequences among those with room for its blocks.
    int rank = -1;
    for (int r = 0; r < ranks_; ++r) {
      const auto ri = static_cast<std::size_t>(r);
      if (config_.kv_blocks_per_rank - rank_blocks_used_[ri] < c.kv_blocks) continue;
      if (rank < 0 || rank_sequences_[ri] < rank_sequences_[static_cast<std::size_t>(rank)]) rank = r;
    }
    if (rank < 0) continue;  // no single rank has the room: it waits
    Waiting& w = waiting_[i];
    const std::uint64_t id = next_id_++;
    rank_blocks_used_[static_cast<std::size_t>(rank)] += c.kv_blocks;
    ++rank_sequences_[static_cast<std::size_t>(rank)];
    for (int r = 0; r < ranks_; ++r)
      predicted_step_load_[static_cast<std::size_t>(r)] += w.load[static_cast<std::size_t>(r)];
    const runtime::SamplingParams& p = w.request->params();
    plan.starts.push_back({id, rank, w.request->prompt(), p.temperature, p.top_k, p.top_p, p.seed,
                           static_cast<std::uint8_t>(p.logprobs),
                           static_cast<std::uint8_t>(p.prompt_logprobs), p.top_logprobs});
    in_step_.emplace_back(id, rank);
    Running run{
        .request = w.request,
        .rank = rank,
        .blocks = c.kv_blocks,
        .stream = OutputStream(w.request->text_output() ? tokenizer_ : nullptr, w.request->stop_strings()),
        .admitted = now};
    if (metrics_ != nullptr) {
      metrics_->observe_queue_time(seconds(now - w.request->arrival()));
      metrics_->add_prompt_tokens(c.tokens);
    }
    running_.emplace(id, std::move(run));
    taken.push_back(i);
  }
  std::sort(taken.rbegin(), taken.rend());
  for (const std::size_t i : taken) waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
  if (!taken.empty()) {
    std::lock_guard lock(inbox_mutex_);
    queued_ -= static_cast<std::int64_t>(taken.size());
  }
}

void Scheduler::plan_drafts(StepPlan& plan) const {
  if (config_.speculative_tokens <= 0 || plan.decodes.empty()) return;
  // Drafts are ordinary tokens of the step: they take what the decodes' own tokens and the admitted prompts
  // leave of the batched tokens, so speculation never delays an admission.
  std::int64_t budget = config_.max_batched_tokens - static_cast<std::int64_t>(plan.decodes.size());
  for (const SequenceStart& s : plan.starts) budget -= static_cast<std::int64_t>(s.prompt.size());
  plan.max_drafts.reserve(plan.decodes.size());
  for (const std::uint64_t id : plan.decodes) {
    const Running& run = running_.at(id);
    const Request& r = *run.request;
    const std::int64_t length = static_cast<std::int64_t>(r.prompt().size()) + run.completion;
    // The step keeps at most drafts + 1 tokens: within max_tokens and the context, so the sequence never
    // outgrows the KV blocks its admission reserved (kv_blocks_needed) and no kept token is past its end.
    const std::int64_t drafts = std::max<std::int64_t>(
        0, std::min({config_.speculative_tokens, r.params().max_new_tokens - run.completion - 1,
                     config_.max_context - length - 1, budget}));
    plan.max_drafts.push_back(static_cast<std::int32_t>(drafts));
    budget -= drafts;
  }
}

void Scheduler::emit_token(std::uint64_t id, Running& run, std::int32_t token, const Scored& scored,
                           Clock::time_point now) {
  const Request& req = *run.request;
  ++run.completion;
  if (metrics_ != nullptr) {
    metrics_->add_generation_tokens(1);
    if (run.completion == 1) {
      metrics_->observe_time_to_first_token(seconds(now - req.arrival()));
    } else {
      metrics_->observe_inter_token_latency(seconds(now - run.last_token));
    }
  }
  if (run.completion == 1) run.first_token = now;
  run.last_token = now;
  const runtime::SamplingParams& p = req.params();
  const bool stop_token =
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
  if (stop_token) {
    finish(id, run, Terminal::ok_stop, "", now);
    return;
  }
  OutputStream::Chunk chunk = run.stream.feed(token);
  if (chunk.stop) {
    finish(id, run, Terminal::ok_stop, "", now);
    return;
  }
  // The token's entry goes with the event that carries it: its own (token output) or the next text delta,
  // since text held back for a stop string covers tokens already fed.
  if (scored.record != nullptr) {
    run.logprobs.append(token, scored.record->logprob, scored.top);
    run.logprob_text_ends.push_back(run.stream.text_bytes());
  }
  RequestEvent e;
  e.text = std::move(chunk.text);
  if (chunk.token) e.tokens.push_back(*chunk.token);
  const auto length = static_cast<std::int64_t>(req.prompt().size()) + run.completion;
  if (!e.text.empty() || !e.tokens.empty()) {
    take_logprobs(run, false, e);
    run.request->push(std::move(e));
  }
  if (run.completion >= p.max_new_tokens || length >= config_.max_context)
    finish(id, run, Terminal::ok_length, "", now);
}

void Scheduler::finish(std::uint64_t id, Running& run, Terminal terminal, const std::string& message,
                       Clock::time_point now) {
  RequestEvent e;
  // Text held back for a stop string that never came is sent at a normal end.
  if (terminal == Terminal::ok_length || terminal == Terminal::ok_stop) e.text = run.stream.finish();
  e.terminal = terminal;
  e.message = message;
  take_logprobs(run, true, e);
  e.prompt_tokens = static_cast<std::uint32_t>(run.request->prompt().size());
  e.completion_tokens = static_cast<std::uint32_t>(run.completion);
  // Fed tokens: the prompt, each later token, and the drafts the verification rejected.
  e.moe_assignments = static_cast<std::uint64_t>((static_cast<std::int64_t>(run.request->prompt().size()) +
                                                  std::max<std::int64_t>(0, run.completion - 1) +
                                                  run.drafted - run.accepted) *
                                                 config_.assignments_per_token);
  e.moe_dropped = static_cast<std::uint64_t>(run.dropped);
  e.moe_rerouted = static_cast<std::uint64_t>(run.rerouted);
  const Request& r = *run.request;
  const double e2e = seconds(now - r.arrival());
  const bool speculative = config_.speculative_tokens > 0;
  std::optional<double> ttft;
  if (run.completion > 0) ttft = seconds(run.first_token - r.arrival());
  if (metrics_ != nullptr) {
    metrics_->observe_end_to_end_latency(e2e);
    metrics_->observe_request_lengths(static_cast<std::int64_t>(r.prompt().size()), run.completion);
    if (run.completion > 0) {
      metrics_->observe_prefill_time(seconds(run.first_token - run.admitted));
      metrics_->observe_decode_time(seconds(now - run.first_token));
    }
  }
  log_access({.request_id = r.id(),
              .peer = r.peer(),
              .prompt_tokens = static_cast<std::int64_t>(r.prompt().size()),
              .completion_tokens = run.completion,
              .finish_reason = finish_reason(terminal),
              .queue_s = seconds(run.admitted - r.arrival()),
              .ttft_s = ttft,
              .e2e_s = e2e,
              .dropped = run.dropped,
              .rerouted = run.rerouted,
              .drafted = speculative ? std::optional<std::int64_t>(run.drafted) : std::nullopt,
              .accepted = speculative ? std::optional<std::int64_t>(run.accepted) : std::nullopt});
  run.request->push(std::move(e));
  to_free_.push_back(id);
  rank_blocks_used_[static_cast<std::size_t>(run.rank)] -= run.blocks;
  --rank_sequences_[static_cast<std::size_t>(run.rank)];
}

void Scheduler::take_logprobs(Running& run, bool all, RequestEvent& e) {
  if (!run.prompt_logprobs.empty()) e.prompt_logprobs = std::exchange(run.prompt_logprobs, {});
  std::size_t sent = 0;
  while (!run.logprob_text_ends.empty() &&
         (all || run.logprob_text_ends.front() <= run.stream.sent_bytes())) {
    run.logprob_text_ends.pop_front();
    ++sent;
  }
  run.logprobs.move_front(sent, e.logprobs);
}

void Scheduler::complete(std::span<const StepResult> results, const parallel::MoeStepStats& stats,
                         Clock::time_point now) {
  std::int64_t step_tokens = 0;
  for (std::size_t r = 0; r < results.size(); ++r) {
    const StepResult& result = results[r];
    // The result's log-probability records, in the order of its sequences, and their alternatives.
    std::size_t record = 0;
    std::size_t top = 0;
    std::size_t token = 0;  // the next sequence's first token in result.tokens
    if (!result.ok) {
      for (const auto& [id, rank] : in_step_) {
        if (rank != static_cast<std::int32_t>(r)) continue;
        const auto it = running_.find(id);
        if (it == running_.end()) continue;
        finish(id, it->second, Terminal::internal,
               "rank " + std::to_string(r) + " refused the step: " + result.error, now);
        running_.erase(it);
      }
      continue;
    }
    for (const SequenceResult& s : result.sequences) {
      const auto it = running_.find(s.id);
      const std::span<const std::int32_t> tokens(
          result.tokens.data() + token,
          std::min(static_cast<std::size_t>(std::max(0, s.tokens)), result.tokens.size() - token));
      token += tokens.size();
      scored_.clear();
      for (; record < result.logprobs.size() && result.logprobs[record].id == s.id; ++record) {
        const LogprobRecord& rec = result.logprobs[record];
        const auto count = static_cast<std::size_t>(std::max(0, rec.top_count));
        if (count > result.top_logprobs.size() - top) break;  // malformed: no more entries from this rank
        const std::span<const TopLogprob> alternatives(result.top_logprobs.data() + top, count);
        top += count;
        if (it == running_.end()) continue;
        if (rec.prompt != 0) {
          it->second.prompt_logprobs.append(rec.token, rec.logprob, alternatives);
        } else {
          scored_.push_back({&rec, alternatives});
        }
      }
      if (it == running_.end()) continue;
      Running& run = it->second;
      step_tokens +=
          run.completion == 0 ? static_cast<std::int64_t>(run.request->prompt().size()) : 1 + s.drafted;
      run.dropped += s.dropped;
      run.rerouted += s.rerouted;
      run.drafted += s.drafted;
      run.accepted += s.accepted;
      if (metrics_ != nullptr && s.drafted > 0) metrics_->record_speculation(s.drafted, s.accepted);
      // The kept tokens in order, each as a lone token would be: the first that ends the request (stop token,
      // stop string, max_tokens, context) discards the ones after it.
      bool ended = false;
      for (std::size_t k = 0; k < tokens.size() && !ended; ++k) {
        const std::size_t before = to_free_.size();
        emit_token(s.id, run, tokens[k], k < scored_.size() ? scored_[k] : Scored{}, now);
        ended = to_free_.size() > before;
      }
      if (!ended && s.failure != SequenceFailure::none) {
        finish(s.id, run, Terminal::internal,
               "the model's logits for this request are not finite (NaN or infinity) at completion token " +
                   std::to_string(run.completion + 1) + "; no token can be sampled",
               now);
        ended = true;
      }
      if (ended) running_.erase(it);
    }
  }
  // The running batch's realized per-rank load of the dry-run layers, per decode token, times the decodes
  // that continue: what the running sequences will weigh in the next step.
  std::vector<std::int64_t> realized(static_cast<std::size_t>(ranks_), 0);
  const auto layers = static_cast<std::size_t>(
      std::min<std::int64_t>(config_.dry_run_layers, static_cast<std::int64_t>(stats.layers.size())));
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t r = 0; r < realized.size() && r < stats.layers[l].rank_routed_load.size(); ++r)
      realized[r] += stats.layers[l].rank_routed_load[r];
  }
  const double similarity = cosine(predicted_step_load_, realized);
  // An all-zero side (no predictor, or a step without routed tokens) has no direction to compare.
  if (metrics_ != nullptr && step_tokens > 0 && !std::isnan(similarity)) {
    metrics_->set_predictor_cosine(similarity);
    std::vector<double> predicted(predicted_step_load_.begin(), predicted_step_load_.end());
    std::vector<double> real(realized.begin(), realized.end());
    metrics_->set_selector_imbalance(imbalance(predicted), imbalance(real));
  }
  const double per_token = step_tokens > 0 ? 1.0 / static_cast<double>(step_tokens) : 0.0;
  const auto continuing = static_cast<double>(running_.size());
  for (std::size_t r = 0; r < realized.size(); ++r)
    running_load_[r] = static_cast<float>(static_cast<double>(realized[r]) * per_token * continuing);
  last_step_tokens_ = step_tokens;
}

void Scheduler::fail_all(Terminal terminal, const std::string& message) {
  const Clock::time_point now = Clock::now();
  for (auto& [id, run] : running_) finish(id, run, terminal, message, now);
  running_.clear();
  {
    std::lock_guard lock(inbox_mutex_);
    for (auto& r : inbox_) waiting_.push_back({std::move(r), {}, false});
    inbox_.clear();
    queued_ = 0;
    draining_ = true;
  }
  for (Waiting& w : waiting_) end_waiting(w, terminal, message, now);
  waiting_.clear();
}

}  // namespace capserve::server
