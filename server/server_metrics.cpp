// The server's Prometheus metrics. Every series is created in the constructor, and the hot paths hold plain
// pointers to prometheus-cpp's metric objects (owned by their families, which never move them), so recording
// a step is only atomic increments: no label maps, no lookups, no allocation. prometheus-cpp's counters and
// gauges are lock-free atomics; a histogram observation takes the histogram's own short mutex.
#include "server/server_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <array>
#include <exception>
#include <limits>
#include <map>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

namespace capserve::server {
namespace {

using prometheus::Counter;
using prometheus::Gauge;
using prometheus::Histogram;

// Between two tokens of one request: 1 ms .. 60 s.
const Histogram::BucketBoundaries& token_latency_buckets() {
  static const Histogram::BucketBoundaries b{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                             0.5,   1,      2.5,   5,    10,    20,   30,  60};
  return b;
}

// A request's phases and whole life: 1 ms .. 2 h 8 min, as a long generation behind a long queue takes
// (vLLM's end-to-end buckets go as far).
const Histogram::BucketBoundaries& request_latency_buckets() {
  static const Histogram::BucketBoundaries b{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                             0.5,   1,      2.5,   5,    10,    20,   30,  60,
                                             120,   240,    480,   960,  1920,  3840, 7680};
  return b;
}

// Request lengths in tokens: 1, 2, 5, 10, 20, 50, ... up to the first bound at or past the context length.
Histogram::BucketBoundaries length_buckets(std::int64_t max_context) {
  Histogram::BucketBoundaries b;
  for (double decade = 1;; decade *= 10) {
    for (const double step : {1.0, 2.0, 5.0}) {
      b.push_back(decade * step);
      if (decade * step >= static_cast<double>(max_context)) return b;
    }
  }
}

// Batch-selector decisions: 1 us .. 10 ms.
const Histogram::BucketBoundaries& decision_buckets() {
  static const Histogram::BucketBoundaries b{1e-6,   2.5e-6, 5e-6, 1e-5,   2.5e-5, 5e-5, 1e-4,
                                             2.5e-4, 5e-4,   1e-3, 2.5e-3, 5e-3,   1e-2};
  return b;
}

// Per-rank max/mean load: 1 is perfect balance, num_ranks the worst possible.
const Histogram::BucketBoundaries& imbalance_buckets() {
  static const Histogram::BucketBoundaries b{1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8, 16};
  return b;
}

// Cosine similarity of two non-negative load vectors: 0 .. 1, dense near 1 where predictors live.
const Histogram::BucketBoundaries& cosine_buckets() {
  static const Histogram::BucketBoundaries b{0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0};
  return b;
}

// The gRPC status code names (OK excluded); anything else is counted as OTHER so that a caller's typo cannot
// add series without bound.
constexpr std::array<std::string_view, 16> kErrorCodes{
    "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",   "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
    "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",         "DATA_LOSS",
    "UNAUTHENTICATED"};

constexpr std::array<std::string_view, 4> kOutcomeNames{"stop", "length", "cancelled", "error"};

enum Phase { kScheduler, kDispatch, kExpert, kCombine, kNumPhases };
constexpr std::array<std::string_view, kNumPhases> kPhaseNames{"scheduler", "dispatch", "expert", "combine"};

void add_count(Counter* c, std::int64_t n) {
  if (n > 0) c->Increment(static_cast<double>(n));
}

void add_seconds(Counter* c, double s) {
  if (s > 0) c->Increment(s);
}

}  // namespace

struct ServerMetrics::Impl {
  struct Layer {
    std::int64_t id = 0;
    Counter* assignments = nullptr;
    Counter* dropped = nullptr;
    Counter* rerouted = nullptr;
    Counter* wire_bytes = nullptr;
    Gauge* rank_imbalance = nullptr;
    std::array<Counter*, kNumPhases> phase{};
    std::vector<Counter*> expert_tokens;  // [num_experts] with MetricsOptions::per_expert, else empty
    std::vector<Counter*> rank_tokens;    // [num_ranks]
  };

  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();

  Histogram* ttft = nullptr;
  Histogram* itl = nullptr;
  Histogram* e2e = nullptr;
  Histogram* queue_time = nullptr;
  Histogram* prefill_time = nullptr;
  Histogram* decode_time = nullptr;
  Histogram* prompt_length = nullptr;
  Histogram* generation_length = nullptr;
  Gauge* kv_usage = nullptr;
  std::vector<Gauge*> kv_used_blocks;  // [num_ranks]
  Gauge* kv_total_blocks = nullptr;
  Gauge* running = nullptr;
  Gauge* waiting = nullptr;
  Counter* prompt_tokens = nullptr;
  Counter* generation_tokens = nullptr;
  Counter* prefix_query_tokens = nullptr;
  Counter* prefix_hit_tokens = nullptr;
  Counter* prefix_query_blocks = nullptr;
  Counter* prefix_hit_blocks = nullptr;
  std::vector<Gauge*> prefix_cached_blocks;  // [num_ranks]
  Counter* prefix_evictions = nullptr;
  Counter* prefill_chunks = nullptr;
  Counter* prefill_computed = nullptr;
  Counter* chunked_prefills = nullptr;
  // [0]: standard, [1]: protected.
  std::array<Counter*, 2> class_requests{};
  std::array<Counter*, 2> class_dropped{};
  std::array<Counter*, 2> class_rerouted{};
  Counter* spec_drafted = nullptr;
  Counter* spec_accepted = nullptr;
  std::vector<Counter*> spec_position_drafted;   // [speculative_tokens]
  std::vector<Counter*> spec_position_accepted;  // [speculative_tokens]
  std::array<Counter*, kOutcomeNames.size()> outcomes{};
  std::array<Counter*, kErrorCodes.size()> errors{};
  Counter* other_error = nullptr;

  Counter* moe_steps = nullptr;
  Histogram* rank_imbalance_hist = nullptr;
  std::vector<Layer> layers;

  Histogram* selector_decision = nullptr;
  Gauge* selector_predicted = nullptr;
  Gauge* selector_realized = nullptr;
  Gauge* predictor_cosine = nullptr;
  Histogram* selector_predicted_hist = nullptr;
  Histogram* selector_realized_hist = nullptr;
  Histogram* predictor_cosine_hist = nullptr;

  Layer* find_layer(std::size_t position, std::int64_t id) {
    // The step's layers come in the model's order, so the entry at the same position is the one almost
    // always.
    if (position < layers.size() && layers[position].id == id) return &layers[position];
    for (auto& l : layers) {
      if (l.id == id) return &l;
    }
    return nullptr;
  }
};

ServerMetrics::ServerMetrics(std::span<const std::int64_t> moe_layers, std::int64_t num_experts,
                             int num_ranks, const MetricsOptions& options)
    : impl_(std::make_unique<Impl>()) {
  if (num_experts < 0) throw std::invalid_argument("ServerMetrics: num_experts must be >= 0");
  if (num_ranks < 1) throw std::invalid_argument("ServerMetrics: num_ranks must be >= 1");
  if (options.model_name.empty()) throw std::invalid_argument("ServerMetrics: the model name is empty");
  if (options.max_context < 1) throw std::invalid_argument("ServerMetrics: max_context must be >= 1");
  for (std::size_t i = 0; i < moe_layers.size(); ++i) {
    if (std::find(moe_layers.begin(), moe_layers.begin() + static_cast<std::ptrdiff_t>(i), moe_layers[i]) !=
        moe_layers.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw std::invalid_argument("ServerMetrics: MoE layer " + std::to_string(moe_layers[i]) +
                                  " listed twice");
    }
  }

  Impl& m = *impl_;
  auto& reg = *m.registry;

  // Every family carries the model's name as a constant label, so that dashboards built for vLLM or SGLang
  // (which filter and group by model_name) find the series.
  const prometheus::Labels model{{"model_name", options.model_name}};
  auto histogram_family = [&](const char* name, const char* help) -> prometheus::Family<Histogram>& {
    return prometheus::BuildHistogram().Name(name).Help(help).Labels(model).Register(reg);
  };
  auto gauge_family = [&](const char* name, const char* help) -> prometheus::Family<Gauge>& {
    return prometheus::BuildGauge().Name(name).Help(help).Labels(model).Register(reg);
  };
  auto counter_family = [&](const char* name, const char* help) -> prometheus::Family<Counter>& {
    return prometheus::BuildCounter().Name(name).Help(help).Labels(model).Register(reg);
  };
  auto histogram = [&](const char* name, const char* help, const Histogram::BucketBoundaries& buckets) {
    return &histogram_family(name, help).Add({}, buckets);
  };
  auto gauge = [&](const char* name, const char* help) { return &gauge_family(name, help).Add({}); };
  auto counter = [&](const char* name, const char* help) { return &counter_family(name, help).Add({}); };

  gauge_family("capserve_build_info",
               "Always 1; the labels say which build serves: version, git_commit, build_type (CMake), device "
               "(the ranks' backend: cpu or cuda).")
      .Add({{"version", options.version},
            {"git_commit", options.git_commit},
            {"build_type", options.build_type},
            {"device", options.device}})
      .Set(1);

  // Requests.
  m.ttft =
      histogram("capserve_time_to_first_token_seconds",
                "Time from a request's arrival to its first generated token (queue time plus prefill). "
                "High while queue time is low: prefill is slow (long prompts, too few threads); high with "
                "high queue time: the server is overloaded.",
                request_latency_buckets());
  m.itl = histogram("capserve_inter_token_latency_seconds",
                    "Time between consecutive generated tokens of one request (one decode step as the client "
                    "sees it). Rises with batch size and with MoE rank imbalance (see "
                    "capserve_moe_rank_imbalance and capserve_moe_phase_seconds_total).",
                    token_latency_buckets());
  m.e2e = histogram("capserve_end_to_end_latency_seconds",
                    "Time from a request's arrival to its terminal status, whatever the finish reason.",
                    request_latency_buckets());
  m.queue_time = histogram("capserve_queue_time_seconds",
                           "Time a request waited before being admitted to the running batch. Growing: the "
                           "server is saturated (add ranks or lower load), or the admission limits (max "
                           "sequences, max batched tokens, KV blocks) are too tight.",
                           request_latency_buckets());
  m.prefill_time =
      histogram("capserve_request_prefill_time_seconds",
                "Time from a request's admission to its first generated token (the prefill step), "
                "per request that generated a token. Long: prompts are long for the batched-token "
                "budget, or the ranks are slow (see capserve_moe_phase_seconds_total).",
                request_latency_buckets());
  m.decode_time = histogram("capserve_request_decode_time_seconds",
                            "Time from a request's first generated token to its end (the decode phase), per "
                            "request that generated a token.",
                            request_latency_buckets());
  m.prompt_length = histogram("capserve_request_prompt_tokens",
                              "Prompt length of each finished request that was admitted, in tokens.",
                              length_buckets(options.max_context));
  m.generation_length = histogram("capserve_request_generation_tokens",
                                  "Tokens generated for each finished request that was admitted (whatever "
                                  "its finish reason).",
                                  length_buckets(options.max_context));
  m.kv_usage = gauge("capserve_kv_cache_usage_ratio",
                     "Share of the KV cache blocks of all ranks reserved by running requests (0..1; each "
                     "request reserves its prompt plus max_tokens). Near 1 with requests waiting: the KV "
                     "cache is the admission limit (raise --kv-blocks or lower max_tokens).");
  auto& kv_used = gauge_family("capserve_kv_cache_used_blocks",
                               "KV cache blocks reserved by running requests, per rank (data-parallel "
                               "sequences each live on one rank).");
  m.kv_used_blocks.reserve(static_cast<std::size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) m.kv_used_blocks.push_back(&kv_used.Add({{"rank", std::to_string(r)}}));
  m.kv_total_blocks =
      gauge("capserve_kv_cache_total_blocks", "KV cache blocks of each rank (--kv-blocks; 16 tokens each).");
  m.running =
      gauge("capserve_requests_running",
            "Requests admitted to the batch and decoding now (at most the configured max sequences).");
  m.waiting =
      gauge("capserve_requests_waiting",
            "Requests queued and not yet admitted. Steadily non-zero means the server is at capacity.");
  m.prompt_tokens =
      counter("capserve_prompt_tokens_total",
              "Prompt tokens of admitted requests (prefill work); rate() gives prefill throughput.");
  m.generation_tokens = counter("capserve_generation_tokens_total",
                                "Tokens generated for clients; rate() gives decode throughput.");
  m.prefix_query_tokens = counter("capserve_prefix_cache_query_tokens_total",
                                  "Prefix cache: prompt tokens of admitted requests looked up in the cache "
                                  "(requests asking for prompt log-probabilities are computed whole and not "
                                  "looked up).");
  m.prefix_hit_tokens = counter("capserve_prefix_cache_hit_tokens_total",
                                "Prefix cache: prompt tokens taken from the cache instead of being computed; "
                                "divided by capserve_prefix_cache_query_tokens_total, the token hit rate.");
  m.prefix_query_blocks = counter("capserve_prefix_cache_query_blocks_total",
                                  "Prefix cache: full KV blocks of the prompts looked up.");
  m.prefix_hit_blocks = counter("capserve_prefix_cache_hit_blocks_total",
                                "Prefix cache: full KV blocks found cached; divided by "
                                "capserve_prefix_cache_query_blocks_total, the block hit rate.");
  auto& cached_blocks = gauge_family("capserve_prefix_cache_cached_blocks",
                                     "Prefix cache: KV blocks holding cached content on each rank, held by "
                                     "running sequences or idle (idle ones are evicted, least recently used "
                                     "first, when blocks are needed).");
  m.prefix_cached_blocks.reserve(static_cast<std::size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r)
    m.prefix_cached_blocks.push_back(&cached_blocks.Add({{"rank", std::to_string(r)}}));
  m.prefix_evictions = counter("capserve_prefix_cache_evictions_total",
                               "Prefix cache: cached blocks reused for other content (all ranks).");
  m.prefill_chunks = counter("capserve_prefill_chunks_total",
                             "Prefill chunks run: a prompt is prefilled in chunks that share each step's "
                             "--max-batched-tokens with the decodes.");
  m.prefill_computed =
      counter("capserve_prefill_tokens_computed_total",
              "Prompt tokens computed by prefill chunks (prompt tokens minus those taken from "
              "the prefix cache).");
  m.chunked_prefills = counter("capserve_chunked_prefills_total",
                               "Finished requests whose prompt took more than one prefill chunk.");
  auto& class_requests = counter_family("capserve_capacity_class_requests_total",
                                        "Finished requests by capacity class (standard, protected).");
  auto& class_dropped = counter_family(
      "capserve_capacity_class_dropped_assignments_total",
      "Expert assignments of finished requests the capacity scheduler dropped, by the requests' "
      "capacity class (protected requests' tokens are never dropped).");
  auto& class_rerouted = counter_family("capserve_capacity_class_rerouted_assignments_total",
                                        "Expert assignments of finished requests the capacity scheduler "
                                        "rerouted, by the requests' capacity class.");
  for (std::size_t c = 0; c < 2; ++c) {
    const std::map<std::string, std::string> label{{"capacity_class", c == 0 ? "standard" : "protected"}};
    m.class_requests[c] = &class_requests.Add(label);
    m.class_dropped[c] = &class_dropped.Add(label);
    m.class_rerouted[c] = &class_rerouted.Add(label);
  }
  if (options.speculative_tokens > 0) {
    m.spec_drafted =
        counter("capserve_spec_draft_tokens_total",
                "Speculative decoding: draft tokens verified by the target model (ordinary tokens "
                "of their step: they count against --max-batched-tokens and expert capacity).");
    m.spec_accepted = counter("capserve_spec_accepted_tokens_total",
                              "Speculative decoding: verified draft tokens the verification kept; divided by "
                              "capserve_spec_draft_tokens_total, the acceptance rate.");
    auto& drafted = counter_family("capserve_spec_position_draft_tokens_total",
                                   "Speculative decoding: draft tokens verified at each draft position (0: "
                                   "right after the sampled token).");
    auto& accepted =
        counter_family("capserve_spec_position_accepted_tokens_total",
                       "Speculative decoding: draft tokens kept at each draft position; divided by "
                       "capserve_spec_position_draft_tokens_total of the same position, that "
                       "position's acceptance rate.");
    for (std::int64_t j = 0; j < options.speculative_tokens; ++j) {
      m.spec_position_drafted.push_back(&drafted.Add({{"position", std::to_string(j)}}));
      m.spec_position_accepted.push_back(&accepted.Add({{"position", std::to_string(j)}}));
    }
  }

  auto& outcomes =
      prometheus::BuildCounter()
          .Name("capserve_requests_total")
          .Labels(model)
          .Help(
              "Requests finished, by finish_reason: stop (stop sequence or end of sequence), "
              "length (max_tokens or context limit reached), cancelled (the client went away), "
              "error (see capserve_request_errors_total for the code, e.g. DEADLINE_EXCEEDED). Requests "
              "refused before admission (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE while "
              "draining) never started and are counted only in capserve_request_errors_total.")
          .Register(reg);
  for (std::size_t i = 0; i < kOutcomeNames.size(); ++i) {
    m.outcomes[i] = &outcomes.Add({{"finish_reason", std::string(kOutcomeNames[i])}});
  }
  auto& errors =
      prometheus::BuildCounter()
          .Name("capserve_request_errors_total")
          .Labels(model)
          .Help(
              "Requests that ended with a gRPC error status, by code. INVALID_ARGUMENT: fix the "
              "client's request (parameters, prompt length, model name); RESOURCE_EXHAUSTED: the "
              "queue is full (add capacity or make clients back off); DEADLINE_EXCEEDED: client "
              "deadlines are shorter than queue time plus generation; UNAVAILABLE: draining or a rank "
              "died (check the ranks' logs); INTERNAL: a server bug (check the logs). OTHER: a code "
              "name this server does not know.")
          .Register(reg);
  for (std::size_t i = 0; i < kErrorCodes.size(); ++i) {
    m.errors[i] = &errors.Add({{"code", std::string(kErrorCodes[i])}});
  }
  m.other_error = &errors.Add({{"code", "OTHER"}});

  // MoE layers.
  m.moe_steps =
      counter("capserve_moe_steps_total",
              "Engine steps whose MoE statistics were recorded; divide the other capserve_moe_ rates by "
              "its rate for per-step figures.");
  m.rank_imbalance_hist = histogram(
      "capserve_moe_rank_imbalance_ratio",
      "Distribution of the per-rank load imbalance (max/mean tokens per rank, after capacity) of every MoE "
      "layer of "
      "every step, all layers together. 1 is perfect balance; a step runs at the speed of its most loaded "
      "rank, "
      "so a ratio r wastes about 1-1/r of the expert compute. Much above 1: lower --capacity-factor, or "
      "rebalance the experts over the ranks (--expert-placement).",
      imbalance_buckets());

  auto& assignments =
      prometheus::BuildCounter()
          .Name("capserve_moe_assignments_total")
          .Labels(model)
          .Help(
              "Token-to-expert assignments the router made (tokens * top_k), per MoE layer: the "
              "denominator of the dropped and rerouted ratios.")
          .Register(reg);
  auto& dropped =
      prometheus::BuildCounter()
          .Name("capserve_moe_dropped_assignments_total")
          .Labels(model)
          .Help(
              "Assignments dropped by the capacity scheduler because their expert (or rank) was full: "
              "the token skipped that expert, which can cost output quality. A high share of "
              "capserve_moe_assignments_total: raise --capacity-factor, reroute instead of dropping "
              "(--capacity-policy reroute), or rebalance the placement (--expert-placement).")
          .Register(reg);
  auto& rerouted =
      prometheus::BuildCounter()
          .Name("capserve_moe_rerouted_assignments_total")
          .Labels(model)
          .Help(
              "Assignments moved by the capacity scheduler from a full expert to the token's next "
              "best expert with room, per MoE layer. A high share of capserve_moe_assignments_total "
              "means the routing is skewed well past capacity: raise --capacity-factor or rebalance "
              "the placement.")
          .Register(reg);
  // Per expert only when asked for: layers * experts series would dominate every scrape of a DeepSeek-sized
  // model, while the per-rank series below stay layers * ranks.
  prometheus::Family<Counter>* expert_tokens =
      options.per_expert
          ? &counter_family("capserve_moe_expert_tokens_total",
                            "Tokens each expert computed (after capacity: dropped assignments excluded, "
                            "rerouted ones counted at their new expert), per MoE layer; only with "
                            "--metrics-per-expert. Hot experts are candidates for replication or for a rank "
                            "of their own in --expert-placement.")
          : nullptr;
  auto& rank_tokens =
      prometheus::BuildCounter()
          .Name("capserve_moe_rank_tokens_total")
          .Labels(model)
          .Help(
              "Expert tokens each rank computed (after capacity), per MoE layer: shows which rank "
              "is the straggler. Persistently uneven: move experts off the busiest rank "
              "(--expert-placement).")
          .Register(reg);
  auto& imbalance =
      prometheus::BuildGauge()
          .Name("capserve_moe_rank_imbalance")
          .Labels(model)
          .Help(
              "Per-rank load imbalance (max/mean tokens per rank, after capacity) of the last "
              "recorded step, per MoE layer. 1 is perfect balance; the step waits for the most "
              "loaded rank. See capserve_moe_rank_imbalance_ratio for the distribution over steps.")
          .Register(reg);
  auto& phases =
      prometheus::BuildCounter()
          .Name("capserve_moe_phase_seconds_total")
          .Labels(model)
          .Help(
              "Time spent per MoE layer in each phase (slowest rank of each step): scheduler "
              "(capacity scheduling), dispatch (all-to-all of tokens to their experts' ranks), expert "
              "(expert FFNs), combine (all-to-all back). dispatch+combine dominating: the interconnect "
              "is the bottleneck (fewer ranks per node or less traffic); expert dominating with high "
              "imbalance: balance the load.")
          .Register(reg);
  auto& bytes =
      prometheus::BuildCounter()
          .Name("capserve_moe_alltoall_bytes_total")
          .Labels(model)
          .Help(
              "Bytes sent between different ranks by the MoE all-to-all (dispatch plus combine), per "
              "layer; rate() is the interconnect bandwidth the MoE layers use.")
          .Register(reg);

  m.layers.reserve(moe_layers.size());
  for (const std::int64_t id : moe_layers) {
    const std::string layer = std::to_string(id);
    Impl::Layer l;
    l.id = id;
    l.assignments = &assignments.Add({{"layer", layer}});
    l.dropped = &dropped.Add({{"layer", layer}});
    l.rerouted = &rerouted.Add({{"layer", layer}});
    l.wire_bytes = &bytes.Add({{"layer", layer}});
    l.rank_imbalance = &imbalance.Add({{"layer", layer}});
    l.rank_imbalance->Set(1);
    for (int p = 0; p < kNumPhases; ++p) {
      l.phase[static_cast<std::size_t>(p)] =
          &phases.Add({{"layer", layer}, {"phase", std::string(kPhaseNames[static_cast<std::size_t>(p)])}});
    }
    if (expert_tokens != nullptr) {
      l.expert_tokens.reserve(static_cast<std::size_t>(num_experts));
      for (std::int64_t e = 0; e < num_experts; ++e)
        l.expert_tokens.push_back(&expert_tokens->Add({{"layer", layer}, {"expert", std::to_string(e)}}));
    }
    l.rank_tokens.reserve(static_cast<std::size_t>(num_ranks));
    for (int r = 0; r < num_ranks; ++r) {
      l.rank_tokens.push_back(&rank_tokens.Add({{"layer", layer}, {"rank", std::to_string(r)}}));
    }
    m.layers.push_back(std::move(l));
  }

  // Batch selection and the router dry-run predictor.
  m.selector_decision = histogram(
      "capserve_batch_selector_decision_seconds",
      "Time the batch selector took to choose which waiting requests to admit. Approaching the step "
      "time: shrink the selection window or use a cheaper strategy (power_of_d, fcfs).",
      decision_buckets());
  m.selector_predicted = gauge("capserve_batch_selector_predicted_imbalance",
                               "Per-rank load imbalance (max/mean) the batch selector predicted for its last "
                               "admitted batch (NaN until the first decision); compare with "
                               "capserve_batch_selector_realized_imbalance.");
  m.selector_realized =
      gauge("capserve_batch_selector_realized_imbalance",
            "Per-rank load imbalance (max/mean) the last admitted batch actually had. Well above "
            "the predicted value: the predictor is inaccurate (see capserve_predictor_load_cosine). "
            "NaN until the first measurement.");
  m.predictor_cosine =
      gauge("capserve_predictor_load_cosine",
            "Cosine similarity of the load predictor's per-layer per-rank load and the realized "
            "one, last measurement (1 = exact shape). Low: balance-aware selection is working "
            "from bad predictions; fit a load map for the model (capserve-eval-predictor "
            "--write-map) or fall back to fcfs. NaN until the first measurement.");
  // The same per step as distributions, so that a run's mean (sum / count) can be read, not only the last
  // step.
  auto& step_imbalance =
      prometheus::BuildHistogram()
          .Name("capserve_batch_selector_step_imbalance_ratio")
          .Labels(model)
          .Help(
              "Per-rank load imbalance (max/mean, the mean over the predicted MoE layers) of every step's "
              "batch: kind predicted (running sequences' last loads + the admitted requests' predicted "
              "loads) and realized. "
              "Selection lowers realized only as far as predicted follows it.")
          .Register(reg);
  m.selector_predicted_hist = &step_imbalance.Add({{"kind", "predicted"}}, imbalance_buckets());
  m.selector_realized_hist = &step_imbalance.Add({{"kind", "realized"}}, imbalance_buckets());
  m.predictor_cosine_hist = histogram("capserve_predictor_step_load_cosine",
                                      "Cosine similarity of predicted and realized per-rank load, every step "
                                      "(see capserve_predictor_load_cosine).",
                                      cosine_buckets());
  // Not measured yet: NaN, which no threshold alert fires on (0 would read as a perfect or a useless
  // predictor).
  m.selector_predicted->Set(std::numeric_limits<double>::quiet_NaN());
  m.selector_realized->Set(std::numeric_limits<double>::quiet_NaN());
  m.predictor_cosine->Set(std::numeric_limits<double>::quiet_NaN());
}

ServerMetrics::~ServerMetrics() = default;

std::string ServerMetrics::exposition() const {
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

void ServerMetrics::observe_time_to_first_token(double seconds) {
  impl_->ttft->Observe(seconds);
}
void ServerMetrics::observe_inter_token_latency(double seconds) {
  impl_->itl->Observe(seconds);
}
void ServerMetrics::observe_end_to_end_latency(double seconds) {
  impl_->e2e->Observe(seconds);
}
void ServerMetrics::observe_queue_time(double seconds) {
  impl_->queue_time->Observe(seconds);
}

void ServerMetrics::observe_prefill_time(double seconds) {
  impl_->prefill_time->Observe(seconds);
}
void ServerMetrics::observe_decode_time(double seconds) {
  impl_->decode_time->Observe(seconds);
}
void ServerMetrics::observe_request_lengths(std::int64_t prompt_tokens, std::int64_t generation_tokens) {
  impl_->prompt_length->Observe(static_cast<double>(prompt_tokens));
  impl_->generation_length->Observe(static_cast<double>(generation_tokens));
}

void ServerMetrics::set_kv_cache_usage(std::span<const std::int64_t> used_blocks,
                                       std::int64_t blocks_per_rank) {
  Impl& m = *impl_;
  std::int64_t used = 0;
  const std::size_t ranks = std::min(used_blocks.size(), m.kv_used_blocks.size());
  for (std::size_t r = 0; r < ranks; ++r) {
    m.kv_used_blocks[r]->Set(static_cast<double>(used_blocks[r]));
    used += used_blocks[r];
  }
  m.kv_total_blocks->Set(static_cast<double>(blocks_per_rank));
  const auto total = static_cast<double>(blocks_per_rank) * static_cast<double>(m.kv_used_blocks.size());
  m.kv_usage->Set(total > 0 ? static_cast<double>(used) / total : 0.0);
}

void ServerMetrics::set_requests_running(std::int64_t n) {
  impl_->running->Set(static_cast<double>(n));
}
void ServerMetrics::set_requests_waiting(std::int64_t n) {
  impl_->waiting->Set(static_cast<double>(n));
}
void ServerMetrics::add_prompt_tokens(std::int64_t n) {
  add_count(impl_->prompt_tokens, n);
}
void ServerMetrics::add_generation_tokens(std::int64_t n) {
  add_count(impl_->generation_tokens, n);
}

void ServerMetrics::record_prefix_lookup(std::int64_t prompt_tokens, std::int64_t cached_tokens,
                                         std::int64_t block_size) {
  Impl& m = *impl_;
  add_count(m.prefix_query_tokens, prompt_tokens);
  add_count(m.prefix_hit_tokens, cached_tokens);
  add_count(m.prefix_query_blocks, prompt_tokens / block_size);
  add_count(m.prefix_hit_blocks, cached_tokens / block_size);
}
void ServerMetrics::set_prefix_cached_blocks(int rank, std::int64_t blocks) {
  const auto r = static_cast<std::size_t>(rank);
  if (r < impl_->prefix_cached_blocks.size())
    impl_->prefix_cached_blocks[r]->Set(static_cast<double>(blocks));
}
void ServerMetrics::add_prefix_evictions(std::int64_t n) {
  add_count(impl_->prefix_evictions, n);
}
void ServerMetrics::record_prefill_chunks(std::int64_t chunks, std::int64_t tokens) {
  add_count(impl_->prefill_chunks, chunks);
  add_count(impl_->prefill_computed, tokens);
}
void ServerMetrics::count_chunked_prefill() {
  impl_->chunked_prefills->Increment();
}

void ServerMetrics::record_capacity_class(bool protect, std::int64_t dropped, std::int64_t rerouted) {
  const std::size_t c = protect ? 1 : 0;
  impl_->class_requests[c]->Increment();
  add_count(impl_->class_dropped[c], dropped);
  add_count(impl_->class_rerouted[c], rerouted);
}

void ServerMetrics::record_speculation(std::int64_t drafted, std::int64_t accepted) {
  Impl& m = *impl_;
  if (m.spec_drafted == nullptr) return;  // the server does not speculate
  add_count(m.spec_drafted, drafted);
  add_count(m.spec_accepted, accepted);
  const auto positions = static_cast<std::int64_t>(m.spec_position_drafted.size());
  for (std::int64_t j = 0; j < std::min(drafted, positions); ++j) {
    m.spec_position_drafted[static_cast<std::size_t>(j)]->Increment();
    if (j < accepted) m.spec_position_accepted[static_cast<std::size_t>(j)]->Increment();
  }
}

void ServerMetrics::count_outcome(Outcome outcome) {
  const auto i = static_cast<std::size_t>(outcome);
  if (i < impl_->outcomes.size()) impl_->outcomes[i]->Increment();
}

void ServerMetrics::count_error(const std::string& grpc_code) {
  for (std::size_t i = 0; i < kErrorCodes.size(); ++i) {
    if (kErrorCodes[i] == grpc_code) {
      impl_->errors[i]->Increment();
      return;
    }
  }
  impl_->other_error->Increment();
}

void ServerMetrics::record_step(const parallel::MoeStepStats& step) {
  Impl& m = *impl_;
  m.moe_steps->Increment();
  for (std::size_t i = 0; i < step.layers.size(); ++i) {
    const parallel::MoeLayerStats& s = step.layers[i];
    Impl::Layer* l = m.find_layer(i, s.layer);
    if (l == nullptr) continue;  // not a layer this server was told about: nothing to attribute it to
    add_count(l->assignments, s.assignments);
    add_count(l->dropped, s.dropped);
    add_count(l->rerouted, s.rerouted);
    add_count(l->wire_bytes, s.wire_bytes);
    const std::size_t experts = std::min(s.expert_load.size(), l->expert_tokens.size());
    for (std::size_t e = 0; e < experts; ++e) add_count(l->expert_tokens[e], s.expert_load[e]);
    const std::size_t ranks = std::min(s.rank_load.size(), l->rank_tokens.size());
    for (std::size_t r = 0; r < ranks; ++r) add_count(l->rank_tokens[r], s.rank_load[r]);
    add_seconds(l->phase[kScheduler], s.scheduler_seconds);
    add_seconds(l->phase[kDispatch], s.dispatch_seconds);
    add_seconds(l->phase[kExpert], s.expert_seconds);
    add_seconds(l->phase[kCombine], s.combine_seconds);
    // Only steps in which the layer did any work say something about balance.
    if (s.tokens > 0) {
      const double ratio = s.rank_imbalance();
      l->rank_imbalance->Set(ratio);
      m.rank_imbalance_hist->Observe(ratio);
    }
  }
}

void ServerMetrics::observe_selector_decision(double seconds) {
  impl_->selector_decision->Observe(seconds);
}

void ServerMetrics::set_selector_imbalance(double predicted, double realized) {
  impl_->selector_predicted->Set(predicted);
  impl_->selector_realized->Set(realized);
  impl_->selector_predicted_hist->Observe(predicted);
  impl_->selector_realized_hist->Observe(realized);
}

void ServerMetrics::set_predictor_cosine(double cosine) {
  impl_->predictor_cosine->Set(cosine);
  impl_->predictor_cosine_hist->Observe(cosine);
}

}  // namespace capserve::server
