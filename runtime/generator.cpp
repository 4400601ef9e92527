#include "runtime/generator.h"

#include <algorithm>
#include <string>

#include "runtime/speculative/verify.h"

namespace capserve::runtime {

Status generate(Engine& engine, std::span<const std::vector<std::int32_t>> prompts,
                std::span<const SamplingParams> params, bool record_logits, std::vector<Generation>& out,
                Drafter* drafter, SpeculationStats* stats) {
  const std::size_t n = prompts.size();
  if (params.size() != n)
    return Status::invalid_argument("generate: one SamplingParams per prompt is required");
  for (const SamplingParams& p : params) {
    if (Status bad = validate_sampling(p); !bad.ok()) return bad;
  }
  const ModelConfig& config = engine.model().config();
  const auto vocab = static_cast<std::size_t>(config.vocab_size);
  const std::int64_t k = drafter != nullptr ? drafter->max_drafts() : 0;
  out.assign(n, {});
  // Per prompt: what the next step feeds (the last drawn token, then room for k drafts), and with a drafter
  // the whole history it looks up.
  std::vector<std::int32_t> feed(n * static_cast<std::size_t>(k + 1));
  std::vector<std::vector<std::int32_t>> history(drafter != nullptr ? n : 0);
  SampleBatch batch;
  std::vector<std::int32_t> drawn;
  std::vector<bool> done(n, false);
  std::vector<Engine::Work> work;
  std::vector<std::size_t> owner;  // work item -> prompt index
  std::vector<DraftSlot> slots;
  std::vector<std::int64_t> draft_counts;

  for (std::size_t i = 0; i < n; ++i) {
    if (params[i].max_new_tokens == 0) {
      done[i] = true;
    } else {
      work.push_back({static_cast<SequenceId>(i), prompts[i], false});
      owner.push_back(i);
      if (drafter != nullptr) history[i] = prompts[i];
    }
  }
  // Steps are collectives under expert parallelism: every rank keeps stepping (with no work once its own
  // prompts are done) until all ranks are done, and all stop together when any rank's step failed.
  parallel::Communicator& comm = engine.model().communicator();
  Status status;
  while (true) {
    std::int64_t state[2] = {work.empty() ? 0 : 1, status.ok() ? 0 : 1};
    comm.allreduce_sum(state);
    if (state[1] > 0) {
      if (status.ok()) status = Status::internal("generate: a step failed on another rank");
      break;
    }
    if (state[0] == 0) break;
    status = engine.step(work);
    // A drafter that runs the model drafts after every step on every rank, a failed one's included.
    const bool draft_anyway = drafter != nullptr && drafter->collective();
    if (!status.ok()) {
      if (draft_anyway) drafter->propose({}, {});
      continue;
    }
    // One draw per logits row: rows j of an item are draws generated + j.
    batch.clear();
    for (std::size_t w = 0; w < work.size(); ++w) {
      const std::size_t i = owner[w];
      const std::size_t rows = work[w].all_logits ? work[w].tokens.size() : 1;
      // Row j follows the drafts fed before it (fed tokens 1..j; a prefill's one row follows none).
      batch.add(params[i], out[i].tokens.size(), prompts[i], out[i].tokens,
                work[w].tokens.subspan(1, rows - 1), rows);
    }
    drawn.resize(batch.rows());
    engine.sample(batch.inputs(), drawn);
    std::size_t row = 0;
    for (std::size_t w = 0; w < work.size() && status.ok(); ++w) {
      const std::size_t i = owner[w];
      const std::size_t rows = work[w].all_logits ? work[w].tokens.size() : 1;
      const std::span<const std::int32_t> draws(drawn.data() + row, rows);
      // Drafts are the fed tokens after the first (none in a prefill, whose one row is its last position).
      const std::span<const std::int32_t> drafts = work[w].tokens.subspan(1, rows - 1);
      const std::size_t kept = kept_draws(drafts, draws);
      if (stats != nullptr && !drafts.empty()) stats->record(drafts.size(), kept - 1);
      for (std::size_t j = 0; j < kept && !done[i]; ++j) {
        const std::int32_t token = draws[j];
        if (kernels::is_failed_draw(token)) {
          const Status failed = failed_draw_error(token);
          status = Status(failed.code(), "prompt " + std::to_string(i) + ": " + failed.message());
          break;
        }
        out[i].tokens.push_back(token);
        if (drafter != nullptr) history[i].push_back(token);
        if (record_logits) {
          const std::span<const float> logits = engine.logits().subspan((row + j) * vocab, vocab);
          out[i].logits.insert(out[i].logits.end(), logits.begin(), logits.end());
        }
        feed[i * static_cast<std::size_t>(k + 1)] = token;
        done[i] = is_stop_token(params[i], token) ||
                  static_cast<std::int64_t>(out[i].tokens.size()) >= params[i].max_new_tokens;
      }
      // The cache keeps the fed tokens whose draws were kept; the last kept draw is fed next step.
      if (!drafts.empty() && !done[i])
        engine.truncate(static_cast<SequenceId>(i), engine.length(i) - rows + kept);
      row += rows;
    }
    if (!status.ok()) {
      if (draft_anyway) drafter->propose({}, {});
      continue;  // every rank stops at the next check
    }
    work.clear();
    owner.clear();
    slots.clear();
    for (std::size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      owner.push_back(i);
      if (drafter == nullptr) continue;
      // Drafts past the token budget or the context would be verified for nothing (or refused).
      const std::int64_t room =
          std::min({k, params[i].max_new_tokens - 1 - static_cast<std::int64_t>(out[i].tokens.size()),
                    config.max_context_length() - 1 - engine.length(i)});
      slots.push_back({static_cast<SequenceId>(i), history[i],
                       std::span(feed).subspan(i * static_cast<std::size_t>(k + 1) + 1,
                                               static_cast<std::size_t>(std::max<std::int64_t>(room, 0)))});
    }
    draft_counts.assign(slots.size(), 0);
    if (drafter != nullptr && (!slots.empty() || draft_anyway)) drafter->propose(slots, draft_counts);
    for (std::size_t w = 0; w < owner.size(); ++w) {
      const std::size_t i = owner[w];
      const auto fed = static_cast<std::size_t>(1 + (drafter != nullptr ? draft_counts[w] : 0));
      work.push_back({static_cast<SequenceId>(i),
                      std::span<const std::int32_t>(feed).subspan(i * static_cast<std::size_t>(k + 1), fed),
                      fed > 1, true});
    }
  }
  for (std::size_t i = 0; i < n; ++i) engine.release(static_cast<SequenceId>(i));
  return status;
}

}  // namespace capserve::runtime
