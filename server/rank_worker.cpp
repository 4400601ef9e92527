#include "server/rank_worker.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "runtime/speculative/verify.h"

namespace capserve::server {

StepResult RankWorker::run(const StepPlan& plan) {
  for (const std::uint64_t id : plan.frees) {
    if (sequences_.erase(id) > 0) engine_.release(id);
  }
  work_.clear();
  items_.clear();
  plan_prefills(plan);
  prefills_ = work_.size();
  plan_decodes(plan);

  StepResult result;
  const runtime::Status status = engine_.step(work_);
  if (!status.ok()) {
    // The refused sequences are dropped here; rank 0 ends their requests with the error.
    for (const Item& item : items_) {
      if (sequences_.erase(item.id) > 0) engine_.release(item.id);
    }
    // Their blocks may hold K/V the step never wrote: the cache keeps only what running sequences hold, as
    // rank 0's mirror does on reading this result.
    engine_.drop_idle_cache();
    result.ok = false;
    result.error = status.message();
    return result;
  }
  // Logits rows: one per work item, one per prompt token with prompt_logprobs, one per fed token of a decode
  // verifying drafts. A prefill's token is drawn from its last row (the other rows get greedy draws nobody
  // reads); a decode's row j is draw drawn + j, as the same sequence would draw it without drafts.
  // A decode's row j follows the drafts fed before it (fed tokens 1..j), which its penalties count.
  batch_.clear();
  std::int64_t top_k = 0;
  bool scoring = false;
  for (std::size_t i = 0; i < items_.size(); ++i) {
    const Sequence& seq = sequences_.at(items_[i].id);
    const std::size_t draws = draws_of(i);
    for (std::size_t j = draws; j < rows_of(i); ++j) batch_.add_unread();
    const std::span<const std::int32_t> drafts =
        i < prefills_ ? std::span<const std::int32_t>() : work_[i].tokens.subspan(1);
    batch_.add(seq.params, seq.drawn, seq.prompt, seq.generated, drafts, draws);
    scoring = scoring || seq.params.logprobs || seq.params.prompt_logprobs;
    top_k = std::max<std::int64_t>(top_k, seq.params.top_logprobs);
  }
  constrain_draws();
  tokens_.resize(batch_.rows());
  engine_.sample(batch_.inputs(), tokens_);
  if (scoring) score(top_k);
  const auto counts = engine_.moe_counts();
  result.sequences.reserve(items_.size());
  std::size_t row = 0;
  for (std::size_t i = 0; i < items_.size(); ++i) {
    const std::uint64_t id = items_[i].id;
    Sequence& seq = sequences_.at(id);
    const std::size_t first_row = row;
    row += rows_of(i);
    const std::size_t draw_row = row - draws_of(i);
    const std::span<const std::int32_t> draws(tokens_.data() + draw_row, row - draw_row);
    // A decode's drafts are its fed tokens after the first (none for a prefill).
    const std::span<const std::int32_t> drafts =
        i < prefills_ ? std::span<const std::int32_t>() : work_[i].tokens.subspan(1);
    // An earlier chunk of a prompt draws nothing and keeps nothing.
    const std::size_t kept = draws.empty() ? 0 : runtime::kept_draws(drafts, draws);
    SequenceResult& out = result.sequences.emplace_back();
    out.id = id;
    out.dropped = counts[i].dropped;
    out.rerouted = counts[i].rerouted;
    out.drafted = static_cast<std::int32_t>(drafts.size());
    out.accepted = static_cast<std::int32_t>(std::max<std::size_t>(kept, 1) - 1);
    // A prefill's rows before its draw score the prompt (a verifying decode's rows score its draws, below).
    if (scoring && seq.params.prompt_logprobs && i < prefills_) {
      for (std::size_t r = first_row; r < draw_row; ++r) report(id, seq.params.top_logprobs, r, true, result);
    }
    if (seq.constraint_failed && kept > 0) out.failure = SequenceFailure::constraint;
    for (std::size_t j = 0; j < kept && out.failure == SequenceFailure::none; ++j) {
      const std::int32_t token = draws[j];
      // A failed sequence stays until rank 0 frees it with the request it ends (after the tokens kept
      // before).
      if (kernels::is_failed_draw(token)) {
        out.failure = token == kernels::kNoAllowedToken ? SequenceFailure::no_allowed_token
                                                        : SequenceFailure::non_finite_logits;
        break;
      }
      // Tokens after the stop token that completed the grammar end nowhere: rank 0 ends the request there.
      if (seq.matcher != nullptr && seq.matcher->is_terminated()) break;
      if (seq.matcher != nullptr && !seq.matcher->accept_token(token)) {
        spdlog::error("rank {}: sequence {}: its grammar refuses token {}, drawn under its mask", rank_, id,
                      token);
        out.failure = SequenceFailure::constraint;
        break;
      }
      result.tokens.push_back(token);
      ++out.tokens;
      seq.last = token;
      ++seq.drawn;
      if (drafter_ != nullptr) seq.history.push_back(token);
      if (seq.params.penalized()) seq.generated.push_back(token);
      if (scoring && seq.params.logprobs) report(id, seq.params.top_logprobs, draw_row + j, false, result);
    }
    // The cache keeps the fed tokens whose draws were kept; the last kept draw is fed next step.
    if (!drafts.empty())
      engine_.truncate(id, engine_.length(id) - static_cast<std::int64_t>(drafts.size() + 1 - kept));
  }
  return result;
}

void RankWorker::plan_prefills(const StepPlan& plan) {
  for (const SequenceStart& s : plan.starts) {
    if (s.rank != rank_) continue;
    Sequence seq{.params = s.params,
                 .prompt = s.prompt,
                 .cached = s.cached,
                 .prefilled = s.cached,
                 .history = {},
                 .generated = {},
                 .matcher = nullptr,
                 .constraint_failed = false};
    if (drafter_ != nullptr) {
      // Room for as many generated tokens as the prompt has before the history grows (amortized).
      seq.history.reserve(2 * s.prompt.size());
      seq.history.assign(s.prompt.begin(), s.prompt.end());
    }
    if (!s.params.constraint.empty()) start_constraint(s.id, seq);
    sequences_.insert_or_assign(s.id, std::move(seq));
  }
  for (const PrefillChunk& c : plan.prefills) {
    const auto it = sequences_.find(c.id);
    if (it == sequences_.end()) continue;  // another rank's
    Sequence& seq = it->second;
    const auto prompt = std::span<const std::int32_t>(seq.prompt);
    const std::int64_t begin = seq.prefilled;
    const std::int64_t end =
        std::min<std::int64_t>(begin + c.tokens, static_cast<std::int64_t>(prompt.size()));
    // A new sequence's first chunk names its cached prefix too, which the engine takes from its cache.
    const bool fresh = begin == seq.cached;
    const std::int64_t from = fresh ? 0 : begin;
    // Prompt log-probabilities are scored on the logits of every prompt position.
    work_.push_back(
        {.seq = c.id,
         .tokens = prompt.subspan(static_cast<std::size_t>(from), static_cast<std::size_t>(end - from)),
         .all_logits = seq.params.prompt_logprobs,
         .cached = fresh ? seq.cached : 0,
         .protect = seq.params.protect});
    items_.push_back({c.id, true, begin, end});
    seq.prefilled = end;
  }
}

void RankWorker::plan_decodes(const StepPlan& plan) {
  const std::int64_t k = drafter_ != nullptr ? drafter_->max_drafts() : 0;
  const auto stride = static_cast<std::size_t>(k + 1);
  // Sized before any span into it is taken; indexed by the decode's position in the plan.
  feed_.resize(plan.decodes.size() * stride);
  slots_.clear();
  for (std::size_t d = 0; d < plan.decodes.size(); ++d) {
    const std::uint64_t id = plan.decodes[d];
    const auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;  // another rank's
    std::int32_t* const fed = feed_.data() + d * stride;
    fed[0] = it->second.last;
    work_.push_back({.seq = id,
                     .tokens = std::span<const std::int32_t>(fed, 1),
                     .decode = true,
                     .protect = it->second.params.protect});
    items_.push_back({id, false, 0, 0});
    if (drafter_ == nullptr) continue;
    const std::int64_t room =
        plan.max_drafts.empty() ? 0 : std::clamp<std::int64_t>(plan.max_drafts[d], 0, k);
    slots_.push_back(
        {id, it->second.history, std::span<std::int32_t>(fed + 1, static_cast<std::size_t>(room))});
  }
  if (drafter_ == nullptr) return;
  const std::size_t decode_slots = slots_.size();
  // A prompt's later chunks: the drafter catches up on the chunk before (an MTP drafter's own cache needs
  // every position), with no room to draft.
  for (std::size_t i = 0; i < prefills_; ++i) {
    const Sequence& seq = sequences_.at(items_[i].id);
    if (items_[i].begin > seq.cached) slots_.push_back({items_[i].id, seq.history, {}});
  }
  // A drafter that runs the model (a collective) drafts every step on every rank, with or without decodes.
  if (slots_.empty() && !drafter_->collective()) return;
  // One proposal for all of this rank's decodes; slot s < decode_slots is decode work item prefills_ + s.
  draft_counts_.assign(slots_.size(), 0);
  drafter_->propose(slots_, draft_counts_);
  for (std::size_t s = 0; s < decode_slots; ++s) {
    runtime::Engine::Work& w = work_[prefills_ + s];
    const auto count = static_cast<std::size_t>(
        std::clamp<std::int64_t>(draft_counts_[s], 0, static_cast<std::int64_t>(slots_[s].drafts.size())));
    w.tokens = std::span<const std::int32_t>(w.tokens.data(), 1 + count);
    w.all_logits = count > 0;
  }
}

void RankWorker::start_constraint(std::uint64_t id, Sequence& seq) {
  if (grammars_ == nullptr) {
    spdlog::error(
        "rank {}: sequence {} has an output constraint, and this rank has no tokenizer to compile it", rank_,
        id);
    seq.constraint_failed = true;
    return;
  }
  // Rank 0's intake compiled it; here it is usually a cache hit (on rank 0 always).
  auto compiled = grammars_->get(seq.params.constraint);
  if (!compiled.ok()) {
    spdlog::error("rank {}: sequence {}: its output constraint does not compile here: {}", rank_, id,
                  compiled.status().message());
    seq.constraint_failed = true;
    return;
  }
  seq.matcher = std::make_unique<runtime::grammar::GrammarMatcher>(std::move(*compiled));
}

void RankWorker::constrain_draws() {
  const std::int64_t words = kernels::allowed_words(engine_.model().config().vocab_size);
  std::size_t row = 0;
  for (std::size_t i = 0; i < items_.size(); ++i) {
    row += rows_of(i);
    Sequence& seq = sequences_.at(items_[i].id);
    const std::size_t draws = draws_of(i);
    if (seq.matcher == nullptr || draws == 0) continue;
    // A decode's row j draws after its first j drafts: the grammar takes them for the row's mask and gives
    // them back after. Rows after a draft the grammar refuses are never kept (the draw before it cannot
    // equal it), so they stay unconstrained.
    const std::span<const std::int32_t> drafts =
        i < prefills_ ? std::span<const std::int32_t>() : work_[i].tokens.subspan(1);
    std::int32_t taken = 0;
    for (std::size_t j = 0; j < draws; ++j) {
      if (j > 0) {
        if (!seq.matcher->accept_token(drafts[j - 1])) break;
        ++taken;
      }
      if (!seq.matcher->fill_next_token_bitmask(batch_.allowed_row(row - draws + j, words)).ok())
        seq.constraint_failed = true;
    }
    if (taken > 0 && !seq.matcher->rollback(taken).ok()) seq.constraint_failed = true;
  }
}

std::size_t RankWorker::rows_of(std::size_t item) const {
  const runtime::Engine::Work& w = work_[item];
  return w.all_logits ? w.tokens.size() - static_cast<std::size_t>(w.cached) : 1;
}

std::size_t RankWorker::draws_of(std::size_t item) const {
  if (!items_[item].prefill) return rows_of(item);
  const Sequence& seq = sequences_.at(items_[item].id);
  return items_[item].end == static_cast<std::int64_t>(seq.prompt.size()) ? 1 : 0;
}

void RankWorker::score(std::int64_t top_k) {
  // Each row's next token: a prompt's own, then the token drawn from the prompt's last row; each of a
  // decode's rows is scored on its own draw (the kept ones are reported).
  targets_.clear();
  std::size_t row = 0;
  for (std::size_t i = 0; i < work_.size(); ++i) {
    const std::size_t rows = rows_of(i);
    const std::size_t draws = draws_of(i);
    if (items_[i].prefill) {
      // Rows at positions [end - rows, end): each scores the prompt's next token, the last one of the
      // prompt's last chunk its draw.
      const std::span<const std::int32_t> prompt = sequences_.at(items_[i].id).prompt;
      const auto first = static_cast<std::size_t>(items_[i].end) - rows + 1;
      targets_.insert(targets_.end(), prompt.begin() + static_cast<std::ptrdiff_t>(first),
                      prompt.begin() + static_cast<std::ptrdiff_t>(first + rows - draws));
    }
    targets_.insert(targets_.end(), tokens_.begin() + static_cast<std::ptrdiff_t>(row + rows - draws),
                    tokens_.begin() + static_cast<std::ptrdiff_t>(row + rows));
    row += rows;
  }
  engine_.score(targets_, top_k, scores_);
}
void RankWorker::report(std::uint64_t id, std::int32_t top_count, std::size_t row, bool prompt,
                        StepResult& result) const {
  const auto r = static_cast<std::int64_t>(row);
  result.logprobs.push_back(
      {id, targets_[row], scores_.logprob(r), top_count, prompt ? std::uint8_t{1} : std::uint8_t{0}});
  for (std::int64_t j = 0; j < top_count; ++j)
    result.top_logprobs.push_back({scores_.top_id(r, j), scores_.top_logprob(r, j)});
}

}  // namespace capserve::server
