#pragma once
// The per-step execution of a loaded Model: one ragged batch of new tokens from many sequences (prefill
// chunks and single decode tokens mixed), attention over the paged KV cache, MoE or dense feed-forward per
// layer. Under expert parallelism every rank runs its own sequences (data-parallel attention) and joins every
// MoE layer's collectives.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "parallel/capacity_stage.h"
#include "parallel/moe_stats.h"
#include "parallel/token_dispatcher.h"
#include "runtime/kv_cache.h"
#include "runtime/model.h"
#include "runtime/moe_block.h"

namespace capserve::runtime {

struct ForwardBatch {
  std::span<const std::int32_t> tokens;          // [rows]: every sequence's new tokens, back to back
  std::span<const std::int32_t> positions;       // [rows]
  std::span<const kernels::SequenceSlice> seqs;  // which rows belong to which sequence, and its cache blocks
  std::span<const std::int64_t> logit_rows;      // rows whose next-token logits are wanted
  std::span<const std::uint8_t> decode_rows;     // [rows] or empty (all prefill): 1 = a decode token
  // [rows] or empty (none): 1 = a protected request's token, which the capacity scheduler never drops.
  std::span<const std::uint8_t> protected_rows;
};

// Which layers a pass runs: the decoder's (forward), or the model's multi-token-prediction layers
// (mtp_forward), each stack with its own capacity state and MoE statistics.
enum class LayerStack { decoder, mtp };

// Owns every per-step buffer and the step's capacity, dispatch and statistics state; reads the Model only.
// Several ForwardPasses may run one Model, each with its own state, but not concurrently: they share the
// model's backend and communicator, and interleaved collectives would pair the wrong calls across ranks.
class ForwardPass {
 public:
  // `model` must outlive the pass.
  explicit ForwardPass(const Model& model, LayerStack stack = LayerStack::decoder);

  // Writes the new tokens' K/V into `cache` and fills logits [logit_rows.size(), vocab_size] (a tensor of the
  // model's backend); with `hidden` [rows, hidden_size] also every row's final hidden state (after the final
  // norm: the MTP layers' input). A collective: every rank calls it once per step, with zero rows if it has
  // nothing to run. A decoder pass.
  void forward(const ForwardBatch& batch, KvCache& cache, const kernels::Tensor& logits,
               const kernels::Tensor& hidden = {});
  // MTP layer `depth` (an MTP pass; DeepSeek-V3's MTP module, tools/mtp_reference.py): row r, at position
  // positions[r] of its sequence, joins `hidden` row r (the state at that position: the decoder's final
  // hidden state, or an earlier MTP output) with the embedding of tokens[r] (the token at the next
  // position): eh_proj([enorm(embed); hnorm(hidden)]), the layer (its K/V into the cache's layer
  // num_layers + depth), then for the logit rows shared_head.norm into `out_hidden` [logit rows, hidden]
  // and the head into logits [logit rows, vocab]: the token two positions on. A collective, as forward.
  void mtp_forward(std::int64_t depth, const ForwardBatch& batch, const kernels::Tensor& hidden,
                   KvCache& cache, const kernels::Tensor& logits, const kernels::Tensor& out_hidden);

  // The last forward's MoE statistics over all ranks, one entry per MoE layer of the pass's stack. Their
  // counts come from the device with the step's next synchronisation (the sampled tokens); read before one,
  // they cost one (HostSync::moe_stats). Throws std::logic_error when the step broke the capacity bound its
  // fixed-size exchange relied on (a defect, never a request's fault).
  [[nodiscard]] const parallel::MoeStepStats& last_moe_stats() {
    settle_stats();
    return stats_.step();
  }
  // Router dry run for batch selection: each token's embedding through the first `layers` MoE layers'
  // post-attention RMSNorm and router to its top-k, no attention, no experts, no collective; adds the chosen
  // experts' counts into counts [layers, num_experts]. Not thread-safe with forward (one engine thread).
  void router_dry_run(std::span<const std::int32_t> tokens, std::int64_t layers,
                      std::span<std::int64_t> counts);

  // Sizes the buffers whose size depends on the routing (every MoE layer's, the dispatcher's) for any step of
  // at most `tokens` tokens over all ranks together; Engine's start-up reservation. No collective.
  void reserve_routed(std::int64_t tokens);
  // Forgets the statistics of the forwards so far (the start-up reservation's).
  void reset_run_stats() {
    settle_stats();
    run_stats_ = {};
  }

  // Every forward's statistics so far, summed (for --moe-stats and reports); as last_moe_stats.
  [[nodiscard]] const parallel::RunStats& run_stats() {
    settle_stats();
    return run_stats_;
  }
  // Per row of the last forward's batch: assignment slots dropped / rerouted, summed over layers; as
  // last_moe_stats.
  [[nodiscard]] std::span<const std::int64_t> last_row_dropped() {
    settle_stats();
    return row_counts_.first(row_counts_.size() / 2);
  }
  [[nodiscard]] std::span<const std::int64_t> last_row_rerouted() {
    settle_stats();
    return row_counts_.subspan(row_counts_.size() / 2);
  }

  // Steps of at most this many tokens over all ranks exchange in fixed-size blocks where a capacity bound
  // allows (CapacityStage::fixed_bounds), larger ones with counts the host reads; 0: never in blocks.
  void set_fixed_exchange_tokens(std::int64_t tokens) { fixed_exchange_tokens_ = tokens; }

  // Which form multi-head latent attention takes (default: per sequence, the cheaper one); for tests and
  // benchmarks that compare the forms.
  void set_latent_form(kernels::LatentForm form) { latent_form_ = form; }

 private:
  // The step's activations, rotary tables and capacity state for `batch`; the residual is left to fill.
  void begin_step(const ForwardBatch& batch);
  // The statistics' reduction over ranks (collectives: the device's counts on the stream, the host's
  // figures) and the report's copy to the host, which settle_stats later reads.
  void end_step();
  // Once the report has reached the host (waiting for it if no synchronisation did since): the step's counts
  // into the statistics and the run's sums.
  void settle_stats();
  // Input norm, the layer's attention (grouped-query or multi-head latent) into scratch_.attn, o_proj,
  // residual.
  void attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache);
  // Each returns the attention output [rows, heads * value head dim], before o_proj.
  kernels::Tensor grouped_query_attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache);
  kernels::Tensor latent_attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache);
  [[nodiscard]] float softmax_scale() const;
  void feed_forward(std::int64_t layer, std::int64_t rows);

  const Model& model_;
  const ModelConfig& config_;  // model_'s, named as every step function reads them
  const ModelWeights& weights_;
  LayerStack stack_;
  parallel::CapacityStage scheduler_;
  parallel::TokenDispatcher dispatcher_;
  parallel::StepStatsRecorder stats_;
  parallel::RunStats run_stats_;
  std::vector<std::uint8_t> exempt_;  // [rows]: rows the capacity scheduler may not drop this step
  std::vector<std::int64_t> dry_run_counts_;
  std::int64_t fixed_exchange_tokens_ = 0;
  // The step's report (StepReport layout in forward_pass.cpp) on the host, once it arrives; pending until
  // settle_stats has read it.
  std::vector<std::int64_t> report_host_;
  std::int64_t report_rows_ = 0;
  std::span<const std::int64_t> row_counts_;  // [2, rows] within report_host_: dropped, rerouted
  bool report_pending_ = false;
  std::vector<std::int64_t> mtp_join_;  // [2 * rows]: the MTP input's interleaving of embeddings and states
  kernels::LatentForm latent_form_ = kernels::LatentForm::cheaper;

  // Grow-only activation buffers of the backend, reused by every step.
  struct Scratch {
    // MLA: k holds the latents, v the rope keys, q_lora the low-rank queries.
    kernels::Buffer tokens, residual, normed, q, q_lora, k, v, attn, proj, cos, sin, final_rows, exempt,
        report;
    kernels::Buffer mtp_parts, mtp_joined;  // MTP: [embeddings; states], then each row's pair side by side
    std::vector<float> cos_host, sin_host;  // the step's rotary tables, made on the host
    std::vector<float> dynamic_inv_freq;    // a sequence's frequencies under dynamic rope scaling
    MoeScratch moe;
  } scratch_;
  // The current step's tensors over scratch_ that every layer uses.
  struct Activations {
    kernels::Tensor residual, normed, proj, cos, sin;  // [rows, hidden] x3, [rows, rotary_dim / 2] x2
    kernels::Tensor exempt;                            // u8 [rows] or empty: see exempt_
    kernels::Tensor report;                            // int64: the step's report (forward_pass.cpp)
  } act_;
  struct DryRunScratch {
    kernels::Buffer tokens, embedded, normed, logits, probs, experts, weights, counts;
  } dry_run_;
};

}  // namespace capserve::runtime
