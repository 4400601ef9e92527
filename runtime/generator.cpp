#include "runtime/generator.h"

#include <algorithm>
#include <string>

namespace capserve::runtime {

Status generate(Engine& engine, std::span<const std::vector<std::int32_t>> prompts,
                std::span<const SamplingParams> params, bool record_logits, std::vector<Generation>& out) {
  const std::size_t n = prompts.size();
  if (params.size() != n)
    return Status::invalid_argument("generate: one SamplingParams per prompt is required");
  for (const SamplingParams& p : params) {
    if (std::string why = validate_sampling(p); !why.empty()) return Status::invalid_argument(why);
  }
  const auto vocab = static_cast<std::size_t>(engine.model().config().vocab_size);
  out.assign(n, {});
  std::vector<std::int32_t> last(n);
  std::vector<kernels::SampleControls> controls;
  std::vector<std::int32_t> drawn;
  std::vector<bool> done(n, false);
  std::vector<Engine::Work> work;
  std::vector<std::size_t> owner;  // work item -> prompt index

  for (std::size_t i = 0; i < n; ++i) {
    if (params[i].max_new_tokens == 0) {
      done[i] = true;
    } else {
      work.push_back({static_cast<SequenceId>(i), prompts[i], false});
      owner.push_back(i);
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
    if (!status.ok()) continue;
    controls.clear();
    for (const std::size_t i : owner) controls.push_back(sample_controls(params[i], out[i].tokens.size()));
    drawn.resize(work.size());
    engine.sample(controls, drawn);
    for (std::size_t w = 0; w < work.size(); ++w) {
      const std::size_t i = owner[w];
      const std::int32_t token = drawn[w];
      if (kernels::is_non_finite_token(token)) {
        status =
            Status::internal("prompt " + std::to_string(i) + ": " + non_finite_logits_error(token).message());
        break;
      }
      out[i].tokens.push_back(token);
      if (record_logits) {
        const std::span<const float> row = engine.logits().subspan(w * vocab, vocab);
        out[i].logits.insert(out[i].logits.end(), row.begin(), row.end());
      }
      last[i] = token;
      done[i] = is_stop_token(params[i], token) ||
                static_cast<std::int64_t>(out[i].tokens.size()) >= params[i].max_new_tokens;
    }
    if (!status.ok()) continue;  // every rank stops at the next check
    work.clear();
    owner.clear();
    for (std::size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      work.push_back({static_cast<SequenceId>(i), std::span<const std::int32_t>(&last[i], 1), false});
      owner.push_back(i);
    }
  }
  for (std::size_t i = 0; i < n; ++i) engine.release(static_cast<SequenceId>(i));
  return status;
}

}  // namespace capserve::runtime
