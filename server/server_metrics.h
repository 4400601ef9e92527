#pragma once
// The server's Prometheus metrics (server/README.md, proto/README.md) in prometheus-cpp's registry; rank 0's
// HTTP server answers /metrics with exposition(). Names follow Prometheus conventions with the prefix
// capserve_. Every method is thread-safe (gRPC handler threads and the engine loop both report); none
// allocates per token.
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "parallel/moe_stats.h"

namespace capserve::server {

// How a request ended, as the outcome counters label it.
enum class Outcome { stop, length, cancelled, error };

struct MetricsOptions {
  // The model_name label of every series (as vLLM and SGLang label theirs): the served model's name.
  std::string model_name;
  // Per-expert token series (layers * experts of them: ~15k for DeepSeek-V3) besides the per-rank ones.
  bool per_expert = false;
  // The top bucket of the prompt and generation length histograms: the context length.
  std::int64_t max_context = 4096;
  // Speculative decoding's most drafts per decode (--num-speculative-tokens; 0: off, and no capserve_spec_
  // series): the per-position series are labelled 0 .. speculative_tokens - 1.
  std::int64_t speculative_tokens = 0;
  // capserve_build_info's labels.
  std::string version, git_commit, build_type, device;
};

class ServerMetrics {
 public:
  // moe_layers: the model's MoE layer indices (label values), num_experts, num_ranks.
  ServerMetrics(std::span<const std::int64_t> moe_layers, std::int64_t num_experts, int num_ranks,
                const MetricsOptions& options);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // Every series in the Prometheus text exposition format (version 0.0.4).
  [[nodiscard]] std::string exposition() const;

  // Latency histograms, in seconds.
  void observe_time_to_first_token(double seconds);
  void observe_inter_token_latency(double seconds);
  void observe_end_to_end_latency(double seconds);
  void observe_queue_time(double seconds);
  // A finished request's phases: admission to first token, and first token to its end.
  void observe_prefill_time(double seconds);
  void observe_decode_time(double seconds);
  // A finished request's prompt and generated lengths, in tokens.
  void observe_request_lengths(std::int64_t prompt_tokens, std::int64_t generation_tokens);

  // KV cache blocks reserved on each rank, of blocks_per_rank each.
  void set_kv_cache_usage(std::span<const std::int64_t> used_blocks, std::int64_t blocks_per_rank);

  void set_requests_running(std::int64_t n);
  void set_requests_waiting(std::int64_t n);
  void add_prompt_tokens(std::int64_t n);
  void add_generation_tokens(std::int64_t n);
  // The prefix cache (--prefix-cache): one admitted prompt's lookup (its tokens and full blocks, and those
  // found cached), each rank's cached blocks, and cached blocks reused for other content.
  void record_prefix_lookup(std::int64_t prompt_tokens, std::int64_t cached_tokens, std::int64_t block_size);
  void set_prefix_cached_blocks(int rank, std::int64_t blocks);
  void add_prefix_evictions(std::int64_t n);
  // Chunked prefill: one step's prefill chunks and the prompt tokens they computed; a finished request whose
  // prompt took more than one chunk.
  void record_prefill_chunks(std::int64_t chunks, std::int64_t tokens);
  void count_chunked_prefill();
  // A finished request of capacity class standard or protected, and its assignments the capacity scheduler
  // dropped and rerouted.
  void record_capacity_class(bool protect, std::int64_t dropped, std::int64_t rerouted);
  // One decode's verification (speculative decoding): `drafted` drafts verified, the first `accepted` kept.
  void record_speculation(std::int64_t drafted, std::int64_t accepted);

  // A request's terminal status: by finish reason, and by gRPC status code name for errors
  // ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE", "INTERNAL",
  // ...).
  void count_outcome(Outcome outcome);
  void count_error(const std::string& grpc_code);

  // One engine step's MoE statistics (global, as every rank holds them after the step): per-layer dropped and
  // rerouted assignments, per-expert received tokens, per-rank load imbalance (max/mean, after capacity),
  // dispatch/expert/combine time (slowest rank), all-to-all bytes.
  void record_step(const parallel::MoeStepStats& step);

  // The batch selector: one decision's time, and the imbalance it predicted for the batch vs the one
  // realized.
  void observe_selector_decision(double seconds);
  void set_selector_imbalance(double predicted, double realized);
  // Router dry-run predictor accuracy: cosine of predicted vs realized per-rank load.
  void set_predictor_cosine(double cosine);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace capserve::server
