#pragma once
// The per-rank engine step: each call appends new tokens to any number of sequences (whole prompts, prompt
// chunks or single decoded tokens, mixed freely), runs them as one ragged forward pass, and returns
// next-token logits.
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"
#include "runtime/forward_pass.h"
#include "runtime/kv_cache.h"
#include "runtime/model.h"
#include "runtime/status.h"
#include "runtime/token_logprobs.h"

namespace capserve::runtime {

struct EngineOptions {
  std::int64_t kv_block_size = 16;
  std::int64_t kv_blocks = 1024;
  kernels::DType kv_dtype = kernels::DType::f32;  // K/V cache elements: f32, or bf16 on the CUDA backend
  // The most tokens one step carries over all ranks together (the server's --max-batched-tokens). Above 0,
  // the engine sizes every step buffer of the backend for that step at start-up and seals them
  // (Backend::seal_scratch): no later step allocates or frees device memory, and a step of more tokens is
  // refused (runtime/README.md, "Step memory"). 0: buffers grow on first use (the CPU backend, tests).
  std::int64_t max_step_tokens = 0;
  // Steps of at most this many tokens over all ranks exchange MoE rows in fixed-size blocks wherever the
  // capacity factor bounds every expert's load (runtime/README.md, "Decode without host waits"): no host
  // synchronisation per layer, at the price of full blocks on the wire. Larger steps, and 0, use the counted
  // exchange.
  std::int64_t fixed_exchange_tokens = 1024;
  // The KV cache keeps full blocks by content, shares them between this engine's sequences and lets a new
  // sequence start after a cached prefix (Work::cached; runtime/README.md, "Prefix cache").
  bool prefix_cache = false;
};

class Engine {
 public:
  // Runs its own ForwardPass on the model's backend, which also holds the KV cache. `model` must outlive the
  // engine.
  Engine(const Model& model, const EngineOptions& options);

  struct Work {
    SequenceId seq = 0;  // an unknown id starts a new sequence
    std::span<const std::int32_t> tokens;
    bool all_logits = false;  // logits of every new position instead of only the last one
    // Decode tokens: a sampled token and the draft tokens after it (speculative decoding), which the capacity
    // scheduler treats as the decode phase, as it does a lone token appended to a sequence.
    bool decode = false;
    // A new sequence only: its first `cached` tokens are taken from the prefix cache
    // (KvBlockManager::adopt_prefix), not computed. A multiple of the block size, less than tokens.size()
    // and at most the cached prefix (KvBlockManager::cached_prefix). The step computes the rest, at
    // positions from `cached` on, and its logits rows are those of the computed tokens.
    std::int64_t cached = 0;
    // A protected request's tokens (server/README.md, "Capacity classes"): the capacity scheduler never drops
    // their expert assignments.
    bool protect = false;
  };

  // Runs one step. On success the step's logits hold, for each work item in order, one row (or
  // tokens.size() - cached rows with all_logits) of vocab_size floats: on the backend's device
  // (device_logits), where sample() draws from them, or copied to the host by logits(). On failure no
  // sequence changed: an unknown or invalid token id, an empty work item, a sequence past the model's
  // context (ModelConfig::max_context_length: max_position_embeddings, stretched by dynamic rope scaling), a
  // `cached` the rules of Work::cached refuse (INVALID_ARGUMENT) or too few free KV blocks
  // (RESOURCE_EXHAUSTED). The KV block manager sees, in this order: adopt_prefix for each work item with
  // `cached` (work order), reserve for each work item (work order), and after the forward append_tokens of
  // each work item's computed tokens (work order); a refused step none of them. A server's mirror of the
  // manager repeats exactly that. A collective under expert parallelism: every rank calls it every step, with
  // no work if it has none, and a rank whose work is refused still joins the step's collectives with zero
  // tokens.
  Status step(std::span<const Work> work);
  [[nodiscard]] const kernels::Tensor& device_logits() const { return logits_; }
  // The logits on the host: a synchronisation (HostSync::logits), made once per step on first use; for
  // scoring, dumps and tests, never on the serving path.
  [[nodiscard]] std::span<const float> logits() const;
  // tokens[i] drawn from logits row i under controls[i] (Backend::sample); one synchronisation
  // (HostSync::sampled_tokens).
  void sample(std::span<const kernels::SampleControls> controls, std::span<std::int32_t> tokens);
  // The same with the adjustments of kernels::SampleInputs (runtime::SampleBatch builds them).
  void sample(const kernels::SampleInputs& inputs, std::span<std::int32_t> tokens);
  // The log-probabilities of tokens[i] (one per logits row: a sampled token, or a prompt's next token) and
  // of each row's top_k most likely tokens (Backend::token_logprobs on the device), into `out`; one
  // synchronisation (HostSync::logprobs) whatever the rows, and never a copy of the logits. A token outside
  // the vocabulary scores NaN. std::invalid_argument when tokens do not match the rows or top_k the
  // vocabulary.
  void score(std::span<const std::int32_t> tokens, std::int64_t top_k, TokenLogprobs& out);

  // Per work item of the last successful step: assignment slots the capacity scheduler dropped or rerouted
  // for its tokens, summed over layers.
  struct MoeCounts {
    std::int64_t dropped = 0;
    std::int64_t rerouted = 0;
  };
  // Read after the step's sample() they cost nothing more; before it, one synchronisation
  // (ForwardPass::last_moe_stats).
  [[nodiscard]] std::span<const MoeCounts> moe_counts();

  // The forward pass's statistics and controls (ForwardPass has their contracts).
  [[nodiscard]] const parallel::MoeStepStats& last_moe_stats() { return pass_.last_moe_stats(); }
  [[nodiscard]] const parallel::RunStats& run_stats() { return pass_.run_stats(); }
  void router_dry_run(std::span<const std::int32_t> tokens, std::int64_t layers,
                      std::span<std::int64_t> counts) {
    pass_.router_dry_run(tokens, layers, counts);
  }
  void set_latent_form(kernels::LatentForm form) { pass_.set_latent_form(form); }

  void release(SequenceId seq);
  // Evicts the prefix cache's blocks no sequence holds (KvBlockManager::drop_idle), after a failed step.
  void drop_idle_cache() { cache_.blocks().drop_idle(); }
  // Rolls the sequence back to its first `length` tokens (speculative decoding's rejected drafts): later
  // positions are forgotten, their whole KV blocks freed, and the next step appends at `length`.
  // std::invalid_argument unless 0 < length <= length(seq).
  void truncate(SequenceId seq, std::int64_t length);
  [[nodiscard]] std::int64_t length(SequenceId seq) const;
  [[nodiscard]] const Model& model() const { return model_; }
  [[nodiscard]] const KvCache& cache() const { return cache_; }

  // Multi-token prediction: a model loaded with its MTP layers (ParallelOptions::mtp) drafts with them
  // (runtime/speculative/mtp_drafter.h) through the calls below; every step then also keeps each row's final
  // hidden state, their input. The last successful step's work items: each one's sequence and rows
  // (first_row, num_tokens, start_pos; not its block table).
  [[nodiscard]] std::span<const SequenceId> last_step_seqs() const { return step_seqs_; }
  [[nodiscard]] std::span<const kernels::SequenceSlice> last_step_slices() const { return slices_; }
  struct DraftWork {
    SequenceId seq = 0;                    // a sequence in the cache
    std::int64_t start = 0;                // the position of its first row
    std::span<const std::int32_t> tokens;  // row i: the token at position start + i + 1
    // Row i's state is row state_row + i of the source: the last step's hidden states, or the last draft
    // step's output states (one per logits row).
    std::int64_t state_row = 0;
    bool all_logits = false;  // logits (and output state) of every row instead of only the last one
  };
  enum class DraftInput { step_hidden, draft_hidden };
  // One forward of MTP layer `depth` (ForwardPass::mtp_forward) over the work items' rows, their K/V into
  // the MTP layer's cache at their positions (blocks past a sequence's length are taken until end_drafts).
  // Then device_logits() holds each item's logits rows, and the step's own logits are gone. On failure
  // (unknown sequence, bad token or position, state row out of range: INVALID_ARGUMENT; too few free
  // blocks: RESOURCE_EXHAUSTED; a model without MTP layers: INVALID_ARGUMENT) nothing ran but the
  // collectives, with zero rows. A collective, as step().
  Status draft_step(std::int64_t depth, DraftInput input, std::span<const DraftWork> work);
  // The greedy token of each logits row of the last draft step (a non-finite row's sentinel,
  // kernels::is_non_finite_token); one synchronisation (HostSync::sampled_tokens).
  void draft_argmax(std::span<std::int32_t> tokens);
  // Frees the blocks draft steps took past their sequences' lengths.
  void end_drafts();

  // Sizes every step buffer for steps of up to `max_step_tokens` and seals them
  // (EngineOptions::max_step_tokens, which the constructor passes here). A collective, as a step: every rank
  // calls it together. A server calls it after its ranks agree that each built its engine, so that one rank's
  // failure to build never leaves the others waiting inside this step.
  void reserve_step_memory(std::int64_t max_step_tokens);

 private:
  Status validate(std::span<const Work> work);
  // step(); `record`: tell the block manager the computed tokens (not for the start-up reservation's
  // placeholder tokens, which must never enter the prefix cache).
  Status run_step(std::span<const Work> work, bool record);
  // Cached blocks the step's work items adopt that no sequence holds now, each counted once.
  [[nodiscard]] std::int64_t idle_blocks_adopted(std::span<const Work> work) const;
  // Forgets the last step's rows (and its logits on the host) before a step or a draft step lays out its own.
  void begin_rows();
  Status validate_drafts(std::int64_t depth, DraftInput input, std::span<const DraftWork> work);

  const Model& model_;
  std::int64_t max_step_tokens_ = 0;
  ForwardPass pass_;
  std::unique_ptr<ForwardPass> mtp_pass_;  // with MTP layers only
  KvCache cache_;
  std::unordered_map<SequenceId, std::int64_t> lengths_;
  // Grow-only step buffers.
  std::vector<std::int32_t> tokens_;
  std::vector<std::int32_t> positions_;
  std::vector<kernels::SequenceSlice> slices_;
  std::vector<std::int64_t> logit_rows_;
  std::vector<std::uint8_t> decode_rows_;
  std::vector<std::uint8_t> protected_rows_;  // empty when no work item of the step is protected
  std::vector<SequenceId> step_seqs_;
  std::vector<SequenceId> seen_;  // validate's sorted ids
  kernels::Buffer logits_buffer_, tokens_buffer_, scored_buffer_, scores_buffer_;
  kernels::Tensor logits_;
  // MTP drafting: the step's hidden states, the draft step's rows, their gathered input states and output
  // states, the sequences whose drafts took blocks.
  kernels::Buffer hidden_buffer_, draft_state_buffer_, draft_out_buffer_;
  kernels::Tensor hidden_, draft_out_;
  std::vector<std::int64_t> draft_state_rows_;
  std::vector<SequenceId> drafted_;
  std::vector<kernels::SampleControls> greedy_;
  mutable std::vector<float> host_logits_;
  mutable bool host_logits_current_ = false;
  std::vector<MoeCounts> moe_counts_;
  std::vector<kernels::SequenceSlice> counted_rows_;  // the last step's work items' rows, for moe_counts
  bool moe_counts_current_ = false;
};

}  // namespace capserve::runtime
