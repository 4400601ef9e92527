#include "server/scheduler.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace capserve::server {
namespace {

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

Scheduler::Scheduler(SchedulerConfig config, int ranks, const runtime::Tokenizer* tokenizer,
                     runtime::LoadPredictor* predictor, ServerMetrics* metrics,
                     const std::atomic<bool>* stop_requested)
    : config_(config),
      ranks_(ranks),
      predictor_(predictor),
      metrics_(metrics),
      selector_(config.selector, ranks),
      outputs_(tokenizer, metrics,
               {.max_context = config.max_context,
                .assignments_per_token = config.assignments_per_token,
                .speculative = config.speculative_tokens > 0}),
      kv_(ranks, config.kv_blocks_per_rank, config.kv_block_size, config.prefix_cache),
      load_(ranks, config.dry_run_layers, metrics),
      queue_(config.max_queue, stop_requested),
      rank_sequences_(static_cast<std::size_t>(ranks), 0) {}

std::int64_t Scheduler::context_tokens(const Request& request) const {
  const auto prompt = static_cast<std::int64_t>(request.prompt().size());
  return std::min(config_.max_context, prompt + request.params().max_new_tokens);
}

bool Scheduler::prefilled_whole(const Request& request) const {
  return config_.whole_prefill_above > 0 &&
         static_cast<std::int64_t>(request.prompt().size()) > config_.whole_prefill_above;
}

runtime::Status Scheduler::check_prompt_length(std::int64_t tokens) const {
  if (config_.whole_prefill_above <= 0 || tokens <= config_.whole_prefill_above ||
      tokens <= config_.max_batched_tokens)
    return {};
  return runtime::Status::invalid_argument(
      std::to_string(tokens) + " tokens exceed the " + std::to_string(config_.max_batched_tokens) +
      " batched tokens of a step (--max-batched-tokens); the model's dynamic rope scaling needs a prompt "
      "longer "
      "than its max_position_embeddings (" +
      std::to_string(config_.whole_prefill_above) + ") prefilled in one step");
}

runtime::Status Scheduler::check_fits(const Request& request) const {
  if (runtime::Status s = check_prompt_length(static_cast<std::int64_t>(request.prompt().size())); !s.ok())
    return runtime::Status::invalid_argument("prompt: " + s.message(), "prompt");
  const std::int64_t blocks = kv_.blocks_for(context_tokens(request));
  if (blocks <= config_.kv_blocks_per_rank) return {};
  const auto prompt = static_cast<std::int64_t>(request.prompt().size());
  return runtime::Status::invalid_argument(
      "prompt + sampling.max_tokens: " + std::to_string(prompt + request.params().max_new_tokens) +
          " tokens need " + std::to_string(blocks) + " KV blocks of " +
          std::to_string(config_.kv_block_size) + " tokens, more than the " +
          std::to_string(config_.kv_blocks_per_rank) +
          " blocks of a rank (--kv-blocks); lower max_tokens or shorten the prompt",
      "max_tokens");
}

runtime::Status Scheduler::submit(std::shared_ptr<Request> request) {
  runtime::Status status = check_fits(*request);
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
      w.load.assign(static_cast<std::size_t>(ranks_), 0.0F);
      if (predictor_ != nullptr) predictor_->predict(w.request->prompt(), w.load);
      w.predicted = true;
    }
    // Its first chunk: what the selector weighs this step.
    const auto prompt = static_cast<std::int64_t>(w.request->prompt().size());
    // A prompt prefilled whole asks for all of it (and waits for a step with the room).
    const std::int64_t chunk = prefilled_whole(*w.request) ? prompt : std::min(prompt, budget);
    const double share = static_cast<double>(chunk) / static_cast<double>(std::max<std::int64_t>(prompt, 1));
    std::vector<float>& load = chunk_loads_[i];
    load.resize(w.load.size());
    for (std::size_t r = 0; r < load.size(); ++r)
      load[r] = static_cast<float>(static_cast<double>(w.load[r]) * share);
    candidates_.push_back({chunk, kv_.blocks_for(context_tokens(*w.request)),
                           std::chrono::duration<double, std::milli>(now - w.request->arrival()).count(),
                           load});
  }
  const AdmissionBudget room{config_.max_running - static_cast<std::int64_t>(running_.size()), budget,
                             most_room};
  const auto started = Clock::now();
  const Selection selection = selector_.select(candidates_, load_.predicted(), room, now);
  if (metrics_ != nullptr && selection.selected)
    metrics_->observe_selector_decision(seconds(Clock::now() - started));

  std::vector<std::size_t> taken;
  for (const std::int64_t index : selection.admitted) {
    const auto i = static_cast<std::size_t>(index);
    Waiting& w = waiting_[i];
    const Request& request = *w.request;
    const Placement at = place(request);
    if (at.rank < 0) continue;  // no single rank has the room: it waits
    const auto prompt = static_cast<std::int64_t>(request.prompt().size());
    const std::int64_t chunk = std::min(prompt - at.cached, budget);
    if (chunk <= 0) break;
    if (chunk < prompt - at.cached && prefilled_whole(request)) continue;
    budget -= chunk;
    const std::uint64_t id = next_id_++;
    kv_.open(at.rank, id, request.prompt(), at.cached, context_tokens(request));
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
    taken.push_back(i);
  }
  std::sort(taken.rbegin(), taken.rend());
  for (const std::size_t i : taken) waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
  queue_.left(static_cast<std::int64_t>(taken.size()));
  return budget;
}

Scheduler::Placement Scheduler::place(const Request& request) const {
  // Prompt log-probabilities need the logits of every prompt position: such a prompt is computed whole.
  const bool reuse = !request.params().prompt_logprobs && !prefilled_whole(request);
  const std::int64_t total = context_tokens(request);
  std::int64_t least_busy = -1;
  for (int r = 0; r < ranks_; ++r) {
    const std::int64_t cached = reuse ? kv_.cached_tokens(r, request.prompt()) : 0;
    if (kv_.blocks_needed(r, request.prompt(), cached, total) > kv_.room(r)) continue;
    const std::int64_t busy = rank_sequences_[static_cast<std::size_t>(r)];
    if (least_busy < 0 || busy < least_busy) least_busy = busy;
  }
  Placement best;
  for (int r = 0; r < ranks_; ++r) {
    const std::int64_t cached = reuse ? kv_.cached_tokens(r, request.prompt()) : 0;
    if (kv_.blocks_needed(r, request.prompt(), cached, total) > kv_.room(r)) continue;
    const std::int64_t busy = rank_sequences_[static_cast<std::size_t>(r)];
    // Affinity within the slack; then the least busy (the lowest rank on a tie).
    const bool affine = busy <= least_busy + config_.cache_affinity_slack;
    if (!affine) continue;
    const bool better =
        best.rank < 0 || cached > best.cached ||
        (cached == best.cached && busy < rank_sequences_[static_cast<std::size_t>(best.rank)]);
    if (better) best = {r, cached};
  }
  return best;
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
      for (const Item& item : in_step_) {
        if (item.rank != static_cast<std::int32_t>(r) || !running_.contains(item.id)) continue;
        outputs_.close(item.id, Terminal::internal,
                       "rank " + std::to_string(r) + " refused the step: " + result.error, now);
        release(item.id);
      }
      continue;
    }
    std::size_t token = 0, record = 0, top = 0;
    for (const SequenceResult& s : result.sequences) {
      // This sequence's tokens, records and alternatives: consecutive in the result.
      SequenceOutput out;
      out.id = s.id;
      out.result = &s;
      out.tokens = std::span(result.tokens)
                       .subspan(token, std::min(static_cast<std::size_t>(std::max(0, s.tokens)),
                                                result.tokens.size() - token));
      token += out.tokens.size();
      const std::size_t first_record = record, first_top = top;
      for (; record < result.logprobs.size() && result.logprobs[record].id == s.id; ++record) {
        const auto count = static_cast<std::size_t>(std::max(0, result.logprobs[record].top_count));
        if (count > result.top_logprobs.size() - top) break;  // malformed: no more entries from this rank
        top += count;
      }
      out.records = std::span(result.logprobs).subspan(first_record, record - first_record);
      out.top = std::span(result.top_logprobs).subspan(first_top, top - first_top);
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
