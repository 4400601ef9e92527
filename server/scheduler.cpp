#include "server/scheduler.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace capserve::server {
namespace {

// The MoE layers the selector balances, one load per rank in each: the predictor's (one, all zero, without).
std::int64_t balanced_layers(const runtime::LoadPredictor* predictor) {
  return predictor != nullptr ? std::max<std::int64_t>(predictor->layers(), 1) : 1;
}

}  // namespace

Scheduler::Scheduler(SchedulerConfig config, int ranks, const runtime::Tokenizer* tokenizer,
                     runtime::LoadPredictor* predictor, ServerMetrics* metrics,
                     const std::atomic<bool>* stop_requested)
    : config_(config),
      ranks_(ranks),
      predictor_(predictor),
      metrics_(metrics),
      selector_(config.selector, balanced_layers(predictor) * ranks),
      outputs_(tokenizer, metrics,
               {.max_context = config.max_context,
                .assignments_per_token = config.assignments_per_token,
                .speculative = config.speculative_tokens > 0}),
      kv_(ranks, config.kv_blocks_per_rank, config.kv_block_size, config.prefix_cache),
      load_(ranks, balanced_layers(predictor), metrics),
      limits_({.max_context = config.max_context,
               .max_batched_tokens = config.max_batched_tokens,
               .kv_blocks_per_rank = config.kv_blocks_per_rank,
               .kv_block_size = config.kv_block_size,
               .whole_prefill_above = config.whole_prefill_above}),
      queue_(config.max_queue, stop_requested),
      rank_sequences_(static_cast<std::size_t>(ranks), 0) {}

runtime::Status Scheduler::submit(std::shared_ptr<Request> request) {
  runtime::Status status = limits_.check_fits(*request);
  if (status.ok()) status = queue_.push(request);
  // Refused requests end here, so the access log has their line too (named as their gRPC status).
  if (!status.ok()) outputs_.refused(*request, status.code());
  return status;
}

bool Scheduler::idle() const {
  return queue_.empty() && waiting_.empty() && running_.empty() && to_free_.empty();
}

void Scheduler::expire(Clock::time_point now) {
  // A passed deadline wins over cancellation: gRPC cancels the call at its deadline too.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const bool expired = it->request->expired(now);
    if (expired || it->request->cancelled()) {
      outputs_.end_waiting(*it->request, expired ? Terminal::deadline_exceeded : Terminal::cancelled,
                           expired ? "deadline exceeded while waiting in the queue" : "", now);
      it = waiting_.erase(it);
      queue_.left(1);
    } else {
      ++it;
    }
  }
  std::vector<std::uint64_t> ended;
  for (const auto& [id, run] : running_) {
    if (run.request->expired(now)) {
      outputs_.close(id, Terminal::deadline_exceeded, "deadline exceeded while generating", now);
      ended.push_back(id);
    } else if (run.request->cancelled()) {
      outputs_.close(id, Terminal::cancelled, "", now);
      ended.push_back(id);
    }
  }
  for (const std::uint64_t id : ended) release(id);
}

StepPlan Scheduler::plan(Clock::time_point now) {
  StepPlan plan;
  queue_.take([&](std::shared_ptr<Request> r) { waiting_.push_back({std::move(r), {}, false}); });
  expire(now);
  // The ranks release first, in this order.
  for (const std::uint64_t id : to_free_) kv_.close(id);
  plan.frees = std::exchange(to_free_, {});
  in_step_.clear();
  for (const auto& [id, run] : running_) {
    if (run.decoding) plan.decodes.push_back(id);
  }
  std::sort(plan.decodes.begin(), plan.decodes.end());
  // Every decode's token first: a decode never waits behind a prompt.
  std::int64_t budget = config_.max_batched_tokens - static_cast<std::int64_t>(plan.decodes.size());
  load_.begin_step();
  budget = plan_chunks(plan, budget);
  budget = admit(now, plan, budget);
  plan_drafts(plan, budget);
  settle_kv(plan);
  publish_metrics();
  return plan;
}

std::int64_t Scheduler::plan_chunks(StepPlan& plan, std::int64_t budget) {
  prefilling_.clear();
  for (const auto& [id, run] : running_) {
    if (!run.decoding && run.prompt_done < static_cast<std::int64_t>(run.request->prompt().size()))
      prefilling_.push_back(id);
  }
  // Ids grow with admission: oldest first.
  std::sort(prefilling_.begin(), prefilling_.end());
  for (const std::uint64_t id : prefilling_) {
    if (budget <= 0) break;
    Running& run = running_.at(id);
    const auto prompt = static_cast<std::int64_t>(run.request->prompt().size());
    const std::int64_t chunk = std::min(prompt - run.prompt_done, budget);
    plan.prefills.push_back({id, chunk});
    kv_.grow(id, run.prompt_done + chunk);
    load_.add(run.load, static_cast<double>(chunk) / static_cast<double>(prompt));
    budget -= chunk;
  }
  return budget;
}

std::int64_t Scheduler::admit(Clock::time_point now, StepPlan& plan, std::int64_t budget) {
  if (waiting_.empty() || budget <= 0) return budget;
  const auto window = static_cast<std::size_t>(
      std::min<std::int64_t>(config_.selector.window, static_cast<std::int64_t>(waiting_.size())));
  std::int64_t most_room = 0;
  for (int r = 0; r < ranks_; ++r) most_room = std::max(most_room, kv_.room(r));
  candidates_.clear();
  chunk_loads_.resize(std::max(chunk_loads_.size(), window));
  for (std::size_t i = 0; i < window; ++i) {
    Waiting& w = waiting_[i];
    if (!w.predicted) {
      w.load.assign(static_cast<std::size_t>(balanced_layers(predictor_) * ranks_), 0.0F);
      // A model without routed experts has nothing to predict: its loads stay zero.
      if (predictor_ != nullptr && predictor_->layers() > 0) predictor_->predict(w.request->prompt(), w.load);
      w.predicted = true;
    }
    // Its first chunk: what the selector weighs this step.
    const auto prompt = static_cast<std::int64_t>(w.request->prompt().size());
    // A prompt prefilled whole asks for all of it (and waits for a step with the room).
    const std::int64_t chunk = limits_.prefilled_whole(*w.request) ? prompt : std::min(prompt, budget);
    const double share = static_cast<double>(chunk) / static_cast<double>(std::max<std::int64_t>(prompt, 1));
    std::vector<float>& load = chunk_loads_[i];
    load.resize(w.load.size());
    for (std::size_t r = 0; r < load.size(); ++r)
      load[r] = static_cast<float>(static_cast<double>(w.load[r]) * share);
    candidates_.push_back({chunk, kv_.blocks_for(limits_.context_tokens(*w.request)),
                           std::chrono::duration<double, std::milli>(now - w.request->arrival()).count(),
                           load});
  }
  const AdmissionBudget room{config_.max_running - static_cast<std::int64_t>(running_.size()), budget,
                             most_room};
  const auto started = Clock::now();
  const Selection selection = selector_.select(candidates_, load_.predicted(), room, now);
  if (metrics_ != nullptr && selection.selected)
    metrics_->observe_selector_decision(std::chrono::duration<double>(Clock::now() - started).count());

  taken_.clear();
  for (const std::int64_t index : selection.admitted) {
    const auto i = static_cast<std::size_t>(index);
    Waiting& w = waiting_[i];
    const Request& request = *w.request;
    // Prompt log-probabilities need the logits of every prompt position: such a prompt is computed whole.
    const Placement at =
        choose_rank(kv_, rank_sequences_,
                    {.prompt = request.prompt(),
                     .context_tokens = limits_.context_tokens(request),
                     .reuse_cache = !request.params().prompt_logprobs && !limits_.prefilled_whole(request)},
                    {.slack = config_.cache_affinity_slack, .min_share = config_.cache_affinity_min_share});
    if (at.rank < 0) continue;  // no single rank has the room: it waits
    const auto prompt = static_cast<std::int64_t>(request.prompt().size());
    const std::int64_t chunk = std::min(prompt - at.cached, budget);
    if (chunk <= 0) break;
    if (chunk < prompt - at.cached && limits_.prefilled_whole(request)) continue;
    budget -= chunk;
    const std::uint64_t id = next_id_++;
    kv_.open(at.rank, id, request.prompt(), at.cached, limits_.context_tokens(request));
    kv_.grow(id, at.cached + chunk);
    ++rank_sequences_[static_cast<std::size_t>(at.rank)];
    load_.add(w.load, static_cast<double>(chunk) / static_cast<double>(prompt));
    plan.starts.push_back({id, at.rank, request.prompt(), at.cached, request.params()});
    plan.prefills.push_back({id, chunk});
    if (metrics_ != nullptr && config_.prefix_cache && !request.params().prompt_logprobs)
      metrics_->record_prefix_lookup(prompt, at.cached, config_.kv_block_size);
    outputs_.open(id, w.request, at.cached, now);
    running_.emplace(id, Running{.request = w.request,
                                 .rank = at.rank,
                                 .prompt_done = at.cached,
                                 .length = at.cached,
                                 .load = std::move(w.load)});
    taken_.push_back(i);
  }
  std::sort(taken_.rbegin(), taken_.rend());
  for (const std::size_t i : taken_) waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
  queue_.left(static_cast<std::int64_t>(taken_.size()));
  return budget;
}

void Scheduler::plan_drafts(StepPlan& plan, std::int64_t budget) const {
  if (config_.speculative_tokens <= 0 || plan.decodes.empty()) return;
  // Drafts are ordinary tokens of the step: they take what the decodes' own tokens and the prefill chunks
  // leave of the batched tokens, so speculation never delays a prompt.
  plan.max_drafts.reserve(plan.decodes.size());
  for (const std::uint64_t id : plan.decodes) {
    const Running& run = running_.at(id);
    const Request& r = *run.request;
    const std::int64_t completion = outputs_.completion(id);
    const std::int64_t length = static_cast<std::int64_t>(r.prompt().size()) + completion;
    // The step keeps at most drafts + 1 tokens: within max_tokens and the context, so the sequence never
    // outgrows the KV blocks its admission reserved and no kept token is past its end.
    const std::int64_t drafts = std::max<std::int64_t>(
        0, std::min({config_.speculative_tokens, r.params().max_new_tokens - completion - 1,
                     config_.max_context - length - 1, budget}));
    plan.max_drafts.push_back(static_cast<std::int32_t>(drafts));
    budget -= drafts;
  }
}

void Scheduler::settle_kv(const StepPlan& plan) {
  // The engine's order: the chunks' blocks (reserved while planning), the decodes', then every token.
  for (const std::uint64_t id : plan.decodes) {
    const Running& run = running_.at(id);
    kv_.grow(id, run.length + 1);
  }
  for (const PrefillChunk& c : plan.prefills) {
    Running& run = running_.at(c.id);
    const auto tokens =
        std::span(run.request->prompt())
            .subspan(static_cast<std::size_t>(run.prompt_done), static_cast<std::size_t>(c.tokens));
    kv_.record(c.id, tokens);
    run.prompt_done += c.tokens;
    run.length = run.prompt_done;
    in_step_.push_back({c.id, run.rank, c.tokens});
  }
  for (const std::uint64_t id : plan.decodes) {
    Running& run = running_.at(id);
    kv_.record(id, std::span(&run.next, 1));
    ++run.length;
    in_step_.push_back({id, run.rank, 0});
  }
}

void Scheduler::release(std::uint64_t id) {
  const auto it = running_.find(id);
  if (it == running_.end()) return;
  to_free_.push_back(id);
  --rank_sequences_[static_cast<std::size_t>(it->second.rank)];
  running_.erase(it);
}

void Scheduler::publish_metrics() {
  if (metrics_ == nullptr) return;
  metrics_->set_requests_running(static_cast<std::int64_t>(running_.size()));
  metrics_->set_requests_waiting(static_cast<std::int64_t>(waiting_.size()));
  metrics_->set_kv_cache_usage(kv_.used(), config_.kv_blocks_per_rank);
  if (!config_.prefix_cache) return;
  std::int64_t evictions = 0;
  for (int r = 0; r < ranks_; ++r) {
    metrics_->set_prefix_cached_blocks(r, kv_.cached_blocks(r));
    evictions += kv_.evictions(r);
  }
  metrics_->add_prefix_evictions(evictions - last_evictions_);
  last_evictions_ = evictions;
}

void Scheduler::complete(std::span<const StepResult> results, const parallel::MoeStepStats& stats,
                         Clock::time_point now) {
  std::int64_t step_tokens = 0, chunks = 0;
  for (const Item& item : in_step_) {
    step_tokens += item.chunk;
    chunks += item.chunk > 0 ? 1 : 0;
  }
  if (metrics_ != nullptr && chunks > 0) metrics_->record_prefill_chunks(chunks, step_tokens);
  for (std::size_t r = 0; r < results.size(); ++r) {
    const StepResult& result = results[r];
    if (!result.ok) {
      failed_.clear();
      for (const Item& item : in_step_) {
        if (item.rank != static_cast<std::int32_t>(r) || !running_.contains(item.id)) continue;
        outputs_.close(item.id, Terminal::internal,
                       "rank " + std::to_string(r) + " refused the step: " + result.error, now);
        release(item.id);
        failed_.push_back(item.id);
      }
      kv_.fail_step(static_cast<int>(r), failed_);
      continue;
    }
    SequenceOutputReader reader(result);
    while (std::optional<SequenceOutput> read = reader.next()) {
      SequenceOutput& out = *read;
      const SequenceResult& s = *out.result;
      const auto it = running_.find(s.id);
      if (it == running_.end()) continue;
      Running& run = it->second;
      out.prefill = !run.decoding;
      if (run.decoding) step_tokens += 1 + s.drafted;
      if (!out.tokens.empty()) {
        // The last kept token is fed next; the drafts kept before it are in the cache already.
        run.next = out.tokens.back();
        run.length += s.accepted;
        run.decoding = true;
      }
      if (outputs_.consume(out, now)) release(s.id);
    }
  }
  std::int64_t next_decodes = 0;
  for (const auto& [id, run] : running_) next_decodes += run.decoding ? 1 : 0;
  load_.end_step(stats, step_tokens, next_decodes);
}

void Scheduler::fail_all(Terminal terminal, const std::string& message) {
  const Clock::time_point now = Clock::now();
  for (const auto& [id, run] : running_) outputs_.close(id, terminal, message, now);
  running_.clear();
  queue_.take([&](std::shared_ptr<Request> r) { waiting_.push_back({std::move(r), {}, false}); });
  queue_.close();
  for (Waiting& w : waiting_) outputs_.end_waiting(*w.request, terminal, message, now);
  waiting_.clear();
}

}  // namespace capserve::server
