#include "runtime/engine.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include <spdlog/spdlog.h>

#include "runtime/sampler.h"

namespace capserve::runtime {

namespace {

// The decoder's layers and the loaded MTP layers after them.
KvCacheShape engine_cache_shape(const Model& model, const EngineOptions& options) {
  KvCacheShape shape =
      kv_cache_shape(model.config(), options.kv_block_size, options.kv_blocks, options.kv_dtype);
  shape.num_layers += model.mtp_layers();
  return shape;
}

// The model's attention as the backend's start-up check of its fast kernels sees it.
kernels::AttentionShapes attention_shapes(const ModelConfig& c, const EngineOptions& options) {
  return {c.num_heads,
          c.num_kv_heads,
          c.head_dim,
          options.kv_block_size,
          c.sliding_window,
          options.kv_dtype,
          c.mla ? c.mla->kv_lora_rank : 0,
          c.mla ? c.mla->qk_rope_head_dim : 0};
}

}  // namespace

Engine::Engine(const Model& model, const EngineOptions& options)
    : model_(model),
      pass_(model),
      mtp_pass_(model.mtp_layers() > 0 ? std::make_unique<ForwardPass>(model, LayerStack::mtp) : nullptr),
      cache_(engine_cache_shape(model, options), model.backend(), options.prefix_cache) {
  pass_.set_fixed_exchange_tokens(options.fixed_exchange_tokens);
  if (mtp_pass_) mtp_pass_->set_fixed_exchange_tokens(options.fixed_exchange_tokens);
  for (const kernels::FastKernelCheck& check :
       model_.backend().check_fast_kernels(attention_shapes(model.config(), options))) {
    if (check.in_use) {
      spdlog::info("{}", check.summary);
    } else {
      spdlog::warn("{}", check.summary);
    }
  }
  if (options.max_step_tokens > 0) reserve_step_memory(options.max_step_tokens);
}

void Engine::reserve_step_memory(std::int64_t max_step_tokens) {
  max_step_tokens_ = max_step_tokens;
  kernels::Backend& backend = model_.backend();
  const ModelConfig& c = model_.config();
  backend.seal_scratch(false);  // another engine on the backend may have sealed it
  // What the routing decides: sized for its bounds, which no one step need reach.
  pass_.reserve_routed(max_step_tokens_);
  // What the step's tokens decide: one step of the most tokens the cache can take (no step carries more), in
  // sequences of at most the model's context in whole blocks, every position's logits sampled and scored
  // with the most top log-probabilities; and the router dry run over as many tokens.
  const std::int64_t block = cache_.blocks().block_size();
  const std::int64_t tokens = std::min(max_step_tokens_, cache_.blocks().free_blocks() * block);
  const std::int64_t context = c.max_context_length();
  const std::int64_t per_seq = context >= block ? context / block * block : context;
  const std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens), 0);
  std::vector<Work> work;
  for (std::int64_t first = 0; first < tokens; first += per_seq) {
    work.push_back({static_cast<SequenceId>(work.size()) + 1,
                    std::span(ids).subspan(static_cast<std::size_t>(first),
                                           static_cast<std::size_t>(std::min(per_seq, tokens - first))),
                    true});
  }
  if (Status s = run_step(work, false); !s.ok())
    throw std::runtime_error("Engine: start-up reservation: " + s.message());
  const std::vector<kernels::SampleControls> greedy(static_cast<std::size_t>(tokens));
  std::vector<std::int32_t> drawn(static_cast<std::size_t>(tokens));
  sample(greedy, drawn);
  TokenLogprobs scored;
  score(ids, std::min<std::int64_t>(kMaxTopLogprobs, c.vocab_size), scored);
  std::vector<std::int64_t> counts(model_.moe_layers().size() * static_cast<std::size_t>(c.num_experts));
  router_dry_run(ids, static_cast<std::int64_t>(model_.moe_layers().size()), counts);
  if (mtp_pass_ != nullptr) {
    // A draft step's rows never outnumber the step's before it; this one has them all, each with logits.
    mtp_pass_->reserve_routed(max_step_tokens_);
    std::vector<DraftWork> drafts;
    for (std::size_t i = 0; i < work.size(); ++i)
      drafts.push_back({work[i].seq, 0, work[i].tokens, slices_[i].first_row, true});
    if (Status s = draft_step(0, DraftInput::step_hidden, drafts); !s.ok())
      throw std::runtime_error("Engine: start-up reservation of the MTP draft: " + s.message());
    draft_argmax(drawn);
    end_drafts();
    mtp_pass_->reset_run_stats();
  }
  for (const Work& w : work) release(w.seq);
  slices_.clear();
  step_seqs_.clear();
  pass_.reset_run_stats();
  backend.seal_scratch(true);
}

std::int64_t Engine::length(SequenceId seq) const {
  const auto it = lengths_.find(seq);
  return it == lengths_.end() ? 0 : it->second;
}

void Engine::release(SequenceId seq) {
  cache_.blocks().release(seq);
  lengths_.erase(seq);
}

void Engine::truncate(SequenceId seq, std::int64_t length) {
  const auto it = lengths_.find(seq);
  if (it == lengths_.end() || length <= 0 || length > it->second) {
    throw std::invalid_argument("Engine::truncate: sequence " + std::to_string(seq) + " to " +
                                std::to_string(length) + " tokens (it holds " +
                                std::to_string(it == lengths_.end() ? 0 : it->second) + ")");
  }
  it->second = length;
  cache_.blocks().truncate(seq, length);
}

std::int64_t Engine::idle_blocks_adopted(std::span<const Work> work) const {
  const KvBlockManager& blocks = cache_.blocks();
  std::int64_t idle = 0;
  for (std::size_t j = 0; j < work.size(); ++j) {
    const Work& w = work[j];
    if (w.cached == 0) continue;
    // Two prefixes share exactly the cached blocks of their common whole-block prefix (a block's key is its
    // chain's content), which an earlier item already counted.
    std::int64_t shared = 0;
    for (std::size_t i = 0; i < j; ++i) {
      const auto a = w.tokens.first(static_cast<std::size_t>(w.cached));
      const auto b = work[i].tokens.first(static_cast<std::size_t>(work[i].cached));
      const auto common = static_cast<std::int64_t>(std::ranges::mismatch(a, b).in1 - a.begin());
      shared = std::max(shared, common / blocks.block_size() * blocks.block_size());
    }
    idle += blocks.idle_cached_blocks(w.tokens, w.cached) - blocks.idle_cached_blocks(w.tokens, shared);
  }
  return idle;
}

Status Engine::validate(std::span<const Work> work) {
  const ModelConfig& c = model_.config();
  if (max_step_tokens_ > 0) {
    std::int64_t tokens = 0;
    for (const Work& w : work) tokens += static_cast<std::int64_t>(w.tokens.size()) - w.cached;
    if (tokens > max_step_tokens_) {
      return Status::invalid_argument("step of " + std::to_string(tokens) +
                                      " tokens exceeds the engine's max_step_tokens (" +
                                      std::to_string(max_step_tokens_) + ")");
    }
  }
  // Duplicates by sorting the step's ids in a reused buffer: no allocation per step.
  seen_.clear();
  for (const Work& w : work) seen_.push_back(w.seq);
  std::sort(seen_.begin(), seen_.end());
  if (const auto twice = std::adjacent_find(seen_.begin(), seen_.end()); twice != seen_.end())
    return Status::invalid_argument("sequence " + std::to_string(*twice) + ": appears twice in one step");
  std::int64_t blocks_needed = 0;
  for (const Work& w : work) {
    const auto who = [&w] { return "sequence " + std::to_string(w.seq); };
    if (w.tokens.empty()) return Status::invalid_argument(who() + ": no tokens to process");
    for (const std::int32_t t : w.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return Status::invalid_argument(who() + ": token id " + std::to_string(t) +
                                        " outside the vocabulary [0, " + std::to_string(c.vocab_size) + ")");
      }
    }
    if (w.cached != 0) {
      const std::int64_t block = cache_.blocks().block_size();
      if (lengths_.contains(w.seq))
        return Status::invalid_argument(who() + ": a cached prefix starts a new sequence only");
      if (w.cached < 0 || w.cached % block != 0 || w.cached >= static_cast<std::int64_t>(w.tokens.size())) {
        return Status::invalid_argument(who() + ": cached prefix of " + std::to_string(w.cached) + " of " +
                                        std::to_string(w.tokens.size()) + " tokens (whole blocks of " +
                                        std::to_string(block) + ", at least one token computed)");
      }
      if (const std::int64_t held = cache_.blocks().cached_prefix(w.tokens); w.cached > held) {
        return Status::invalid_argument(who() + ": cached prefix of " + std::to_string(w.cached) +
                                        " tokens, the cache holds " + std::to_string(held));
      }
    }
    const std::int64_t total = length(w.seq) + static_cast<std::int64_t>(w.tokens.size());
    if (total > c.max_context_length()) {
      return Status::invalid_argument(who() + ": " + std::to_string(total) +
                                      " tokens exceed the model's context (" +
                                      std::to_string(c.max_context_length()) + ")");
    }
    const std::int64_t have = lengths_.contains(w.seq)
                                  ? static_cast<std::int64_t>(cache_.blocks().block_table(w.seq).size())
                                  : w.cached / cache_.blocks().block_size();
    blocks_needed += std::max<std::int64_t>(0, cache_.blocks().blocks_for(total) - have);
  }
  // Adopting an idle cached block takes it out of the free blocks as a reservation would.
  blocks_needed += idle_blocks_adopted(work);
  if (blocks_needed > cache_.blocks().free_blocks()) {
    return Status::resource_exhausted("KV cache: step needs " + std::to_string(blocks_needed) + " blocks, " +
                                      std::to_string(cache_.blocks().free_blocks()) + " free");
  }
  return {};
}

void Engine::begin_rows() {
  tokens_.clear();
  positions_.clear();
  slices_.clear();
  logit_rows_.clear();
  decode_rows_.clear();
  protected_rows_.clear();
  step_seqs_.clear();
  host_logits_current_ = false;
}

Status Engine::step(std::span<const Work> work) {
  return run_step(work, true);
}

Status Engine::run_step(std::span<const Work> work, bool record) {
  begin_rows();
  kernels::Backend& backend = model_.backend();
  const std::int64_t vocab = model_.config().vocab_size;
  if (Status s = validate(work); !s.ok()) {
    logits_ = backend.scratch(logits_buffer_, kernels::DType::f32, {0, vocab});
    pass_.forward({tokens_, positions_, slices_, logit_rows_, decode_rows_, {}}, cache_, logits_);
    return s;
  }
  // Every adoption before any reservation: a reservation may evict idle cached blocks, never one a later
  // work item of the same step adopts.
  for (const Work& w : work) {
    if (w.cached == 0) continue;
    if (!cache_.blocks().adopt_prefix(w.seq, w.tokens, w.cached))
      throw std::logic_error("Engine::step: validated cached prefix not adopted");
    lengths_[w.seq] = w.cached;
  }
  const bool any_protected = std::any_of(work.begin(), work.end(), [](const Work& w) { return w.protect; });
  for (const Work& w : work) {
    const std::int64_t start = length(w.seq);
    const std::span<const std::int32_t> computed = w.tokens.subspan(static_cast<std::size_t>(w.cached));
    const auto n = static_cast<std::int64_t>(computed.size());
    // A single token appended to a sequence already in the cache is a decode step.
    decode_rows_.insert(decode_rows_.end(), static_cast<std::size_t>(n),
                        w.decode || (start > 0 && n == 1) ? 1 : 0);
    if (any_protected)
      protected_rows_.insert(protected_rows_.end(), static_cast<std::size_t>(n), w.protect ? 1 : 0);
    cache_.blocks().reserve(w.seq, start + n);  // validated above: always fits
    lengths_[w.seq] = start + n;
    const auto first_row = static_cast<std::int64_t>(tokens_.size());
    tokens_.insert(tokens_.end(), computed.begin(), computed.end());
    for (std::int64_t i = 0; i < n; ++i) positions_.push_back(static_cast<std::int32_t>(start + i));
    slices_.push_back({first_row, n, start, cache_.blocks().block_table(w.seq)});
    step_seqs_.push_back(w.seq);
    if (w.all_logits) {
      for (std::int64_t i = 0; i < n; ++i) logit_rows_.push_back(first_row + i);
    } else {
      logit_rows_.push_back(first_row + n - 1);
    }
  }
  logits_ = backend.scratch(logits_buffer_, kernels::DType::f32,
                            {static_cast<std::int64_t>(logit_rows_.size()), vocab});
  if (mtp_pass_ != nullptr) {
    hidden_ = backend.scratch(hidden_buffer_, kernels::DType::f32,
                              {static_cast<std::int64_t>(tokens_.size()), model_.config().hidden_size});
  }
  pass_.forward({tokens_, positions_, slices_, logit_rows_, decode_rows_, protected_rows_}, cache_, logits_,
                hidden_);
  if (record) {
    for (const Work& w : work)
      cache_.blocks().append_tokens(w.seq, w.tokens.subspan(static_cast<std::size_t>(w.cached)));
  }
  counted_rows_.assign(slices_.begin(), slices_.end());
  moe_counts_current_ = false;
  return {};
}

std::span<const Engine::MoeCounts> Engine::moe_counts() {
  if (moe_counts_current_) return moe_counts_;
  const std::span<const std::int64_t> dropped = pass_.last_row_dropped();
  const std::span<const std::int64_t> rerouted = pass_.last_row_rerouted();
  moe_counts_.assign(counted_rows_.size(), {});
  for (std::size_t i = 0; i < counted_rows_.size(); ++i) {
    const kernels::SequenceSlice& slice = counted_rows_[i];
    for (std::int64_t r = slice.first_row; r < slice.first_row + slice.num_tokens; ++r) {
      moe_counts_[i].dropped += dropped[static_cast<std::size_t>(r)];
      moe_counts_[i].rerouted += rerouted[static_cast<std::size_t>(r)];
    }
  }
  moe_counts_current_ = true;
  return moe_counts_;
}

Status Engine::validate_drafts(std::int64_t depth, DraftInput input, std::span<const DraftWork> work) {
  const ModelConfig& c = model_.config();
  if (mtp_pass_ == nullptr)
    return Status::invalid_argument("draft step: the model was loaded without multi-token-prediction layers");
  if (depth < 0 || depth >= model_.mtp_layers()) {
    return Status::invalid_argument("draft step: MTP layer " + std::to_string(depth) + " of " +
                                    std::to_string(model_.mtp_layers()));
  }
  const kernels::Tensor& source = input == DraftInput::step_hidden ? hidden_ : draft_out_;
  const std::int64_t states = source.dims() == 0 ? 0 : source.dim(0);
  std::unordered_set<SequenceId> seen;
  std::int64_t blocks_needed = 0;
  for (const DraftWork& w : work) {
    const std::string who = "draft step: sequence " + std::to_string(w.seq);
    const auto n = static_cast<std::int64_t>(w.tokens.size());
    if (!lengths_.contains(w.seq)) return Status::invalid_argument(who + ": not in the cache");
    if (!seen.insert(w.seq).second) return Status::invalid_argument(who + ": appears twice in one step");
    if (n == 0) return Status::invalid_argument(who + ": no tokens to process");
    for (const std::int32_t t : w.tokens) {
      if (t < 0 || t >= c.vocab_size)
        return Status::invalid_argument(who + ": token id " + std::to_string(t) + " outside the vocabulary");
    }
    if (w.start < 0 || w.start + n > c.max_context_length())
      return Status::invalid_argument(who + ": positions " + std::to_string(w.start) + "+" +
                                      std::to_string(n) + " outside the model's context");
    if (w.state_row < 0 || w.state_row + n > states) {
      return Status::invalid_argument(who + ": state rows " + std::to_string(w.state_row) + "+" +
                                      std::to_string(n) + " of " + std::to_string(states));
    }
    const auto have = static_cast<std::int64_t>(cache_.blocks().block_table(w.seq).size());
    blocks_needed += std::max<std::int64_t>(0, cache_.blocks().blocks_for(w.start + n) - have);
  }
  if (blocks_needed > cache_.blocks().free_blocks()) {
    return Status::resource_exhausted("KV cache: draft step needs " + std::to_string(blocks_needed) +
                                      " blocks, " + std::to_string(cache_.blocks().free_blocks()) + " free");
  }
  return {};
}

Status Engine::draft_step(std::int64_t depth, DraftInput input, std::span<const DraftWork> work) {
  kernels::Backend& backend = model_.backend();
  const ModelConfig& c = model_.config();
  const Status status = validate_drafts(depth, input, work);
  if (mtp_pass_ == nullptr) return status;
  begin_rows();
  draft_state_rows_.clear();
  if (status.ok()) {
    for (const DraftWork& w : work) {
      const auto n = static_cast<std::int64_t>(w.tokens.size());
      if (w.start + n > length(w.seq)) {
        cache_.blocks().reserve(w.seq, w.start + n);  // validated: fits
        drafted_.push_back(w.seq);
      }
      const auto first_row = static_cast<std::int64_t>(tokens_.size());
      tokens_.insert(tokens_.end(), w.tokens.begin(), w.tokens.end());
      // Decode-phase rows for the capacity scheduler; dynamic rope by each row's own length.
      decode_rows_.insert(decode_rows_.end(), static_cast<std::size_t>(n), 1);
      for (std::int64_t i = 0; i < n; ++i) {
        positions_.push_back(static_cast<std::int32_t>(w.start + i));
        draft_state_rows_.push_back(w.state_row + i);
        if (w.all_logits || i == n - 1) logit_rows_.push_back(first_row + i);
      }
      slices_.push_back({first_row, n, w.start, cache_.blocks().block_table(w.seq)});
    }
  }
  const auto rows = static_cast<std::int64_t>(tokens_.size());
  const auto wanted = static_cast<std::int64_t>(logit_rows_.size());
  const kernels::Tensor state =
      backend.scratch(draft_state_buffer_, kernels::DType::f32, {rows, c.hidden_size});
  // Gathered before the output states are overwritten: a chain step reads the last step's. With no rows there
  // may be no source yet (a rank drafting before its first step).
  if (rows > 0)
    backend.gather_rows(input == DraftInput::step_hidden ? hidden_ : draft_out_, draft_state_rows_, state);
  logits_ = backend.scratch(logits_buffer_, kernels::DType::f32, {wanted, c.vocab_size});
  draft_out_ = backend.scratch(draft_out_buffer_, kernels::DType::f32, {wanted, c.hidden_size});
  // Drafts are proposals: the MTP layers' capacity protects no request's tokens.
  mtp_pass_->mtp_forward(status.ok() ? depth : 0,
                         {tokens_, positions_, slices_, logit_rows_, decode_rows_, {}}, state, cache_,
                         logits_, draft_out_);
  return status;
}

void Engine::draft_argmax(std::span<std::int32_t> tokens) {
  greedy_.resize(tokens.size());
  sample(greedy_, tokens);
}

void Engine::end_drafts() {
  for (const SequenceId seq : drafted_) {
    if (const auto it = lengths_.find(seq); it != lengths_.end()) cache_.blocks().truncate(seq, it->second);
  }
  drafted_.clear();
}

std::span<const float> Engine::logits() const {
  if (!host_logits_current_) {
    host_logits_.resize(static_cast<std::size_t>(logits_.numel()));
    model_.backend().to_host(logits_, std::as_writable_bytes(std::span(host_logits_)),
                             kernels::HostSync::logits);
    host_logits_current_ = true;
  }
  return host_logits_;
}

void Engine::sample(std::span<const kernels::SampleControls> controls, std::span<std::int32_t> tokens) {
  sample(kernels::SampleInputs{.controls = controls}, tokens);
}

void Engine::sample(const kernels::SampleInputs& inputs, std::span<std::int32_t> tokens) {
  kernels::Backend& backend = model_.backend();
  const kernels::Tensor drawn =
      backend.scratch(tokens_buffer_, kernels::DType::i32, {static_cast<std::int64_t>(tokens.size())});
  backend.sample(logits_, inputs, drawn);
  backend.to_host(drawn, std::as_writable_bytes(tokens), kernels::HostSync::sampled_tokens);
}

void Engine::score(std::span<const std::int32_t> tokens, std::int64_t top_k, TokenLogprobs& out) {
  kernels::Backend& backend = model_.backend();
  const std::int64_t rows = logits_.dims() == 0 ? 0 : logits_.dim(0);
  if (static_cast<std::int64_t>(tokens.size()) != rows || top_k < 0 || top_k > model_.config().vocab_size) {
    throw std::invalid_argument("Engine::score: " + std::to_string(tokens.size()) + " tokens and top_k " +
                                std::to_string(top_k) + " for " + std::to_string(rows) +
                                " logits rows of vocabulary " + std::to_string(model_.config().vocab_size));
  }
  const std::span<std::byte> host = out.reset(rows, top_k);
  if (rows == 0) return;
  const kernels::Tensor ids = backend.scratch(scored_buffer_, kernels::DType::i32, {rows});
  backend.from_host(std::as_bytes(tokens), ids);
  // Values and ids side by side in one device buffer, as TokenLogprobs keeps them: one copy back.
  const kernels::Tensor packed =
      backend.scratch(scores_buffer_, kernels::DType::u8, {static_cast<std::int64_t>(host.size())});
  const kernels::Tensor values(packed.data(), kernels::DType::f32, backend.device(), {rows, 1 + top_k});
  const kernels::Tensor top_ids(static_cast<std::byte*>(packed.data()) + values.bytes(), kernels::DType::i32,
                                backend.device(), {rows, top_k});
  backend.token_logprobs(logits_, ids, values, top_ids);
  backend.to_host(packed, host, kernels::HostSync::logprobs);
}

}  // namespace capserve::runtime
