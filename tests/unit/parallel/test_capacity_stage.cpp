// Capacity-aware scheduling (parallel/README.md) against an independent brute-force reference: every
// expert's (or device's) assignments sorted by (score desc, token position in the scope asc, slot asc), the
// first C kept; reroute rounds replayed token by token. The reference sees the whole step at once, so
// comparing it with runs split over 1..4 ranks (in-process thread groups) also checks that global scope is
// the exact global top-C whatever the split. Capacities are computed in exact integer arithmetic (gammas are
// multiples of 1/64).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/capacity_config.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/self_communicator.h"
#include "tests/support/capacity_layer.h"
#include "tests/support/thread_communicator.h"

namespace capserve::parallel {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Rank `rank` of a group of `size` that must not communicate: every collective throws.
class SilentCommunicator final : public Communicator {
 public:
  SilentCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] int size() const override { return size_; }
  [[nodiscard]] kernels::Device device() const override { return kernels::kCpu; }

 protected:
  void do_alltoall(std::span<const std::int64_t> /*send*/, std::span<std::int64_t> /*recv*/,
                   parallel::Stream /*stream*/) override {
    fail("alltoall");
  }
  void do_alltoallv(std::span<const std::byte> /*send*/, std::span<const std::int64_t> /*send_counts*/,
                    std::span<std::byte> /*recv*/, std::span<const std::int64_t> /*recv_counts*/,
                    parallel::Stream /*stream*/) override {
    fail("alltoallv");
  }
  void do_allreduce_sum(std::span<std::int64_t> /*values*/, parallel::Stream /*stream*/) override {
    fail("allreduce_sum");
  }
  void do_allreduce_max(std::span<double> /*values*/, parallel::Stream /*stream*/) override {
    fail("allreduce_max");
  }
  void do_allgather(std::span<const std::int64_t> /*mine*/, std::span<std::int64_t> /*all*/,
                    parallel::Stream /*stream*/) override {
    fail("allgather");
  }

 private:
  [[noreturn]] static void fail(const char* op) {
    throw std::logic_error(std::string("SilentCommunicator: unexpected collective ") + op);
  }
  int rank_;
  int size_;
};

// ---------------------------------------------------------------------------------------------------------
// A step: the tokens of all ranks in global order, one routing per layer.

struct LayerInput {
  std::vector<float> probs;           // [T, E]
  std::vector<std::int32_t> experts;  // [T, k]
  std::vector<float> weights;         // [T, k]
};

struct Case {
  CapacityConfig config;
  std::int64_t T = 0;
  std::int64_t k = 1;
  std::int64_t E = 2;
  std::vector<std::int64_t> split;  // tokens per rank (placement.num_ranks() entries), sum T
  std::shared_ptr<const ExpertPlacement> placement;
  std::vector<LayerInput> layers;    // layer l is model layer l
  std::vector<std::uint8_t> exempt;  // [T] or empty
  bool normalized = false;
  float scaling = 1.0F;
  std::uint64_t generator_seed = 0;  // property test: how this case was made

  [[nodiscard]] int ranks() const { return placement->num_ranks(); }
};

struct Outcome {
  std::vector<std::int32_t> experts;
  std::vector<float> weights;
  std::vector<SlotStatus> status;
  std::int64_t dropped = 0;  // LayerCounts summed over ranks
  std::int64_t rerouted = 0;
};

std::string describe_case(const Case& c) {
  std::ostringstream o;
  o << "case{seed=" << c.generator_seed << " T=" << c.T << " E=" << c.E << " k=" << c.k
    << " ranks=" << c.ranks() << " placement=" << c.placement->kind() << " split=[";
  for (std::size_t r = 0; r < c.split.size(); ++r) o << (r ? "," : "") << c.split[r];
  o << "] layers=" << c.layers.size() << " normalized=" << c.normalized << " scaling=" << c.scaling
    << " exempt=" << (c.exempt.empty() ? "none" : "some") << " " << describe(c.config) << "}";
  return o.str();
}

const char* status_name(SlotStatus s) {
  switch (s) {
    case SlotStatus::kept:
      return "kept";
    case SlotStatus::dropped:
      return "dropped";
    case SlotStatus::rerouted:
      return "rerouted";
  }
  return "?";
}

// Top-k by repeated scan (ties to the lower id), weights as the models compute them: p, or p / (sum of the
// top-k p) when normalized; then times scaling.
LayerInput make_layer(std::vector<float> probs, std::int64_t T, std::int64_t E, std::int64_t k,
                      bool normalized, float scaling) {
  LayerInput in;
  in.probs = std::move(probs);
  in.experts.assign(static_cast<std::size_t>(T * k), -1);
  in.weights.assign(static_cast<std::size_t>(T * k), 0.0F);
  for (std::int64_t t = 0; t < T; ++t) {
    const float* p = in.probs.data() + t * E;
    std::int32_t* ids = in.experts.data() + t * k;
    float* w = in.weights.data() + t * k;
    for (std::int64_t s = 0; s < k; ++s) {
      std::int32_t best = -1;
      for (std::int32_t e = 0; e < E; ++e) {
        if (std::find(ids, ids + s, e) != ids + s) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      ids[s] = best;
      w[s] = p[best];
    }
    if (normalized) {
      float total = 0.0F;
      for (std::int64_t s = 0; s < k; ++s) total += w[s];
      for (std::int64_t s = 0; s < k; ++s) w[s] /= total;
    }
    for (std::int64_t s = 0; s < k; ++s) w[s] *= scaling;
  }
  return in;
}

// Probabilities from raw non-negative scores, normalized per token.
std::vector<float> normalize_rows(std::vector<float> raw, std::int64_t T, std::int64_t E) {
  for (std::int64_t t = 0; t < T; ++t) {
    float sum = 0.0F;
    for (std::int64_t e = 0; e < E; ++e) sum += raw[static_cast<std::size_t>(t * E + e)];
    for (std::int64_t e = 0; e < E; ++e) raw[static_cast<std::size_t>(t * E + e)] /= sum;
  }
  return raw;
}

Case make_case(CapacityConfig config, std::int64_t T, std::int64_t E, std::int64_t k,
               const std::vector<std::vector<float>>& layer_probs, ExpertPlacement placement,
               std::vector<std::int64_t> split = {}, bool normalized = false, float scaling = 1.0F) {
  Case c;
  c.config = std::move(config);
  c.T = T;
  c.E = E;
  c.k = k;
  c.placement = std::make_shared<const ExpertPlacement>(std::move(placement));
  if (split.empty()) {
    split.assign(static_cast<std::size_t>(c.placement->num_ranks()), 0);
    split[0] = T;
  }
  c.split = std::move(split);
  c.normalized = normalized;
  c.scaling = scaling;
  for (const auto& p : layer_probs) c.layers.push_back(make_layer(p, T, E, k, normalized, scaling));
  return c;
}

std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& split) {
  std::vector<std::int64_t> off(split.size() + 1, 0);
  for (std::size_t r = 0; r < split.size(); ++r) off[r + 1] = off[r] + split[r];
  return off;
}

// ---------------------------------------------------------------------------------------------------------
// The implementation, run on the case's split: one rank (SelfCommunicator), ranks without any collective
// (SilentCommunicator: local scope and inactive configs must not communicate), or a thread group.

enum class Transport { automatic, threads };

std::vector<Outcome> run_impl(const Case& c, Transport transport = Transport::automatic) {
  const std::int64_t k = c.k;
  const std::int64_t E = c.E;
  const std::size_t L = c.layers.size();
  std::vector<Outcome> out(L);
  for (std::size_t l = 0; l < L; ++l) {
    out[l].experts = c.layers[l].experts;
    out[l].weights = c.layers[l].weights;
    out[l].status.assign(static_cast<std::size_t>(c.T * k), SlotStatus::dropped);  // must be overwritten
  }
  const std::vector<std::int64_t> off = offsets_of(c.split);
  std::mutex mutex;
  const auto rank_fn = [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const std::int64_t first = off[r];
    const std::int64_t n = c.split[r];
    CapacityStage scheduler(c.config, comm);
    scheduler.begin_step(n);
    for (std::size_t l = 0; l < L; ++l) {
      const auto a = static_cast<std::ptrdiff_t>(first * k);
      const auto b = static_cast<std::ptrdiff_t>((first + n) * k);
      std::vector<std::int32_t> experts(c.layers[l].experts.begin() + a, c.layers[l].experts.begin() + b);
      std::vector<float> weights(c.layers[l].weights.begin() + a, c.layers[l].weights.begin() + b);
      std::vector<SlotStatus> status(static_cast<std::size_t>(n * k), SlotStatus::dropped);
      std::span<const std::uint8_t> exempt;
      if (!c.exempt.empty())
        exempt = std::span<const std::uint8_t>(c.exempt).subspan(static_cast<std::size_t>(first),
                                                                 static_cast<std::size_t>(n));
      const testing::LayerCounts counts = testing::apply_layer(
          scheduler, static_cast<std::int64_t>(l), *c.placement, comm.rank(), n, k,
          std::span<const float>(c.layers[l].probs)
              .subspan(static_cast<std::size_t>(first * E), static_cast<std::size_t>(n * E)),
          experts, weights, status, exempt, c.normalized, c.scaling);
      const std::lock_guard lock(mutex);
      std::copy(experts.begin(), experts.end(), out[l].experts.begin() + a);
      std::copy(weights.begin(), weights.end(), out[l].weights.begin() + a);
      std::copy(status.begin(), status.end(), out[l].status.begin() + a);
      out[l].dropped += counts.dropped;
      out[l].rerouted += counts.rerouted;
    }
  };
  const bool global_active = c.config.scope == CapacityScope::global &&
                             std::any_of(c.layers.begin(), c.layers.end(), [&](const LayerInput& in) {
                               return c.config.active(&in - c.layers.data());
                             });
  if (c.ranks() == 1) {
    SelfCommunicator comm;
    rank_fn(comm);
  } else if (transport == Transport::threads || global_active) {
    test::run_ranks(c.ranks(), rank_fn);
  } else {
    for (int r = 0; r < c.ranks(); ++r) {
      SilentCommunicator comm(r, c.ranks());
      rank_fn(comm);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// The brute-force reference.

std::int64_t exact_capacity(double gamma, std::int64_t T, std::int64_t k, std::int64_t E, std::int64_t n) {
  constexpr std::int64_t kDen = 64;
  const double q = gamma * kDen;
  if (q != std::floor(q)) throw std::invalid_argument("test gammas must be multiples of 1/64");
  const std::int64_t num = static_cast<std::int64_t>(q) * T * k * n;
  return (num + kDen * E - 1) / (kDen * E);
}

// Home rank of every token.
std::vector<int> homes(const Case& c) {
  std::vector<int> home;
  for (std::size_t r = 0; r < c.split.size(); ++r)
    home.insert(home.end(), static_cast<std::size_t>(c.split[r]), static_cast<int>(r));
  return home;
}

// The token groups that schedule together: all tokens (global) or each rank's (local).
std::vector<std::vector<std::int64_t>> scope_groups(const Case& c) {
  std::vector<std::vector<std::int64_t>> groups;
  if (c.config.scope == CapacityScope::global) {
    groups.emplace_back();
    for (std::int64_t t = 0; t < c.T; ++t) groups.back().push_back(t);
    return groups;
  }
  const std::vector<std::int64_t> off = offsets_of(c.split);
  for (std::size_t r = 0; r < c.split.size(); ++r) {
    groups.emplace_back();
    for (std::int64_t t = off[r]; t < off[r + 1]; ++t) groups.back().push_back(t);
  }
  return groups;
}

struct Bins {
  std::int64_t count = 0;
  std::vector<std::int64_t> of_expert;  // [E]
  std::vector<std::int64_t> capacity;   // [count]
};

Bins make_bins(const Case& c, std::int64_t layer, std::int64_t scope_tokens) {
  Bins b;
  const bool device = c.config.granularity == CapacityGranularity::device;
  const double gamma = c.config.gamma_for(layer);
  b.count = device ? c.ranks() : c.E;
  b.of_expert.resize(static_cast<std::size_t>(c.E));
  for (std::int64_t e = 0; e < c.E; ++e)
    b.of_expert[static_cast<std::size_t>(e)] =
        device ? c.placement->owners(layer)[static_cast<std::size_t>(e)] : e;
  for (std::int64_t i = 0; i < b.count; ++i) {
    const std::int64_t n =
        device ? static_cast<std::int64_t>(c.placement->local_experts(layer, static_cast<int>(i)).size()) : 1;
    b.capacity.push_back(exact_capacity(gamma, scope_tokens, c.k, c.E, n));
  }
  return b;
}

bool in_token(const std::int32_t* row, std::int64_t k, std::int32_t e) {
  return std::find(row, row + k, e) != row + k;
}

// The m most probable experts of rank `home` outside the token's original top-k (ties: lower id first).
std::vector<std::int32_t> expanded_fallbacks(const Case& c, std::int64_t layer, std::int64_t t, int home) {
  const LayerInput& in = c.layers[static_cast<std::size_t>(layer)];
  std::vector<std::int32_t> local;
  for (const std::int32_t e : c.placement->local_experts(layer, home)) {
    if (!in_token(in.experts.data() + t * c.k, c.k, e)) local.push_back(e);
  }
  const float* p = in.probs.data() + t * c.E;
  std::sort(local.begin(), local.end(),
            [&](std::int32_t a, std::int32_t b) { return p[a] != p[b] ? p[a] > p[b] : a < b; });
  if (static_cast<std::int64_t>(local.size()) > c.config.local_experts)
    local.resize(static_cast<std::size_t>(c.config.local_experts));
  return local;
}

float reroute_weight(const Case& c, std::int64_t layer, std::int64_t t, std::int32_t e) {
  const LayerInput& in = c.layers[static_cast<std::size_t>(layer)];
  const float p = in.probs[static_cast<std::size_t>(t * c.E + e)];
  if (!c.normalized) return p * c.scaling;
  float denominator = 0.0F;
  for (std::int64_t s = 0; s < c.k; ++s)
    denominator +=
        in.probs[static_cast<std::size_t>(t * c.E + in.experts[static_cast<std::size_t>(t * c.k + s)])];
  return p / denominator * c.scaling;
}

// One competing assignment: slot (t, s) at position `pos` in its scope, with gate weight w.
struct Contender {
  std::int64_t t;
  std::int64_t s;
  std::int64_t pos;
  float w;
  std::int32_t expert;
};

// The score order of parallel/README.md: larger score first, then earlier token, then earlier slot.
bool outranks(DropScore score, const Contender& a, const Contender& b) {
  double sa = 0;
  double sb = 0;
  switch (score) {
    case DropScore::gate:
      sa = a.w > 0 ? a.w : 0.0;
      sb = b.w > 0 ? b.w : 0.0;
      break;
    case DropScore::order:
      sa = -static_cast<double>(a.pos);
      sb = -static_cast<double>(b.pos);
      break;
    case DropScore::reverse_order:
      sa = static_cast<double>(a.pos);
      sb = static_cast<double>(b.pos);
      break;
    case DropScore::random:
      throw std::logic_error("the reference has no random score");
  }
  if (sa != sb) return sa > sb;
  if (a.pos != b.pos) return a.pos < b.pos;
  return a.s < b.s;
}

// Keeps the first `room` contenders by the score order; returns the kept ones.
std::vector<Contender> top(DropScore score, std::vector<Contender> v, std::int64_t room) {
  std::sort(v.begin(), v.end(),
            [&](const Contender& a, const Contender& b) { return outranks(score, a, b); });
  if (static_cast<std::int64_t>(v.size()) > room)
    v.resize(static_cast<std::size_t>(std::max<std::int64_t>(room, 0)));
  return v;
}

// nullopt: the reference cannot say (random score).
std::optional<Outcome> reference(const Case& c, std::int64_t layer) {
  const LayerInput& in = c.layers[static_cast<std::size_t>(layer)];
  const std::int64_t k = c.k;
  Outcome out;
  out.experts = in.experts;
  out.weights = in.weights;
  out.status.assign(static_cast<std::size_t>(c.T * k), SlotStatus::kept);
  if (!c.config.active(layer)) return out;
  if (c.config.score == DropScore::random) return std::nullopt;
  const std::vector<int> home = homes(c);
  const auto slot = [&](std::int64_t t, std::int64_t s) { return static_cast<std::size_t>(t * k + s); };
  const auto exempt = [&](std::int64_t t) {
    return !c.exempt.empty() && c.exempt[static_cast<std::size_t>(t)] != 0;
  };

  for (const std::vector<std::int64_t>& group : scope_groups(c)) {
    const auto G = static_cast<std::int64_t>(group.size());
    const Bins bins = make_bins(c, layer, G);
    // Drop.
    std::vector<std::vector<Contender>> contenders(static_cast<std::size_t>(bins.count));
    std::vector<std::int64_t> exempt_load(static_cast<std::size_t>(bins.count), 0);
    for (std::int64_t pos = 0; pos < G; ++pos) {
      const std::int64_t t = group[static_cast<std::size_t>(pos)];
      for (std::int64_t s = 0; s < k; ++s) {
        const std::int32_t e = in.experts[slot(t, s)];
        const auto b = static_cast<std::size_t>(bins.of_expert[static_cast<std::size_t>(e)]);
        if (exempt(t)) {
          ++exempt_load[b];
        } else {
          contenders[b].push_back({t, s, pos, in.weights[slot(t, s)], e});
        }
      }
    }
    std::vector<std::int64_t> room(static_cast<std::size_t>(bins.count));
    for (std::size_t b = 0; b < room.size(); ++b) {
      const std::int64_t cap = std::max<std::int64_t>(0, bins.capacity[b] - exempt_load[b]);
      const std::vector<Contender> kept = top(c.config.score, contenders[b], cap);
      room[b] = cap - static_cast<std::int64_t>(kept.size());
      for (const Contender& x : contenders[b]) {
        const bool keep = std::any_of(kept.begin(), kept.end(),
                                      [&](const Contender& y) { return y.t == x.t && y.s == x.s; });
        if (keep) continue;
        out.experts[slot(x.t, x.s)] = -1;
        out.weights[slot(x.t, x.s)] = 0.0F;
        out.status[slot(x.t, x.s)] = SlotStatus::dropped;
      }
    }
    // Reroute rounds.
    const bool expanded = c.config.policy == CapacityPolicy::expanded;
    if (c.config.policy == CapacityPolicy::reroute || expanded) {
      for (std::int64_t round = 0; round < c.config.rounds; ++round) {
        std::vector<std::vector<Contender>> wants(static_cast<std::size_t>(bins.count));
        for (std::int64_t pos = 0; pos < G; ++pos) {
          const std::int64_t t = group[static_cast<std::size_t>(pos)];
          std::vector<std::int32_t> picked;  // this round, this token
          std::vector<std::int32_t> allowed;
          if (expanded) {
            allowed = expanded_fallbacks(c, layer, t, home[static_cast<std::size_t>(t)]);
          } else {
            for (std::int32_t e = 0; e < c.E; ++e) allowed.push_back(e);
          }
          for (std::int64_t s = 0; s < k; ++s) {
            if (out.status[slot(t, s)] != SlotStatus::dropped) continue;
            std::int32_t best = -1;
            for (const std::int32_t e : allowed) {
              if (room[static_cast<std::size_t>(bins.of_expert[static_cast<std::size_t>(e)])] <= 0) continue;
              if (in_token(in.experts.data() + t * k, k, e) || in_token(out.experts.data() + t * k, k, e) ||
                  std::find(picked.begin(), picked.end(), e) != picked.end())
                continue;
              const float pe = in.probs[static_cast<std::size_t>(t * c.E + e)];
              const float pb = best < 0 ? 0.0F : in.probs[static_cast<std::size_t>(t * c.E + best)];
              if (best < 0 || pe > pb || (pe == pb && e < best)) best = e;
            }
            if (best < 0) continue;
            picked.push_back(best);
            wants[static_cast<std::size_t>(bins.of_expert[static_cast<std::size_t>(best)])].push_back(
                {t, s, pos, reroute_weight(c, layer, t, best), best});
          }
        }
        for (std::size_t b = 0; b < wants.size(); ++b) {
          for (const Contender& x : top(c.config.score, wants[b], room[b])) {
            out.experts[slot(x.t, x.s)] = x.expert;
            out.weights[slot(x.t, x.s)] = x.w;
            out.status[slot(x.t, x.s)] = SlotStatus::rerouted;
          }
          room[b] -= std::min<std::int64_t>(room[b], static_cast<std::int64_t>(wants[b].size()));
        }
      }
    }
  }
  if (c.config.renormalize_after_drop) {
    for (std::int64_t t = 0; t < c.T; ++t) {
      float original = 0.0F;
      float kept = 0.0F;
      bool lost = false;
      for (std::int64_t s = 0; s < k; ++s) {
        original += in.weights[slot(t, s)];
        kept += out.weights[slot(t, s)];
        lost = lost || out.status[slot(t, s)] == SlotStatus::dropped;
      }
      if (lost && kept > 0) {
        for (std::int64_t s = 0; s < k; ++s) out.weights[slot(t, s)] *= original / kept;
      }
    }
  }
  for (const SlotStatus s : out.status) {
    out.dropped += s == SlotStatus::dropped ? 1 : 0;
    out.rerouted += s == SlotStatus::rerouted ? 1 : 0;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// Comparisons and invariants. Each returns an empty string when fine, else the first fault found.

std::string compare(const Outcome& want, const Outcome& got, std::int64_t k, bool weights_near) {
  for (std::size_t i = 0; i < want.status.size(); ++i) {
    const bool weight_ok = weights_near ? std::fabs(want.weights[i] - got.weights[i]) <=
                                              1e-6F * std::max(1.0F, std::fabs(want.weights[i]))
                                        : std::memcmp(&want.weights[i], &got.weights[i], sizeof(float)) == 0;
    if (want.experts[i] != got.experts[i] || want.status[i] != got.status[i] || !weight_ok) {
      std::ostringstream o;
      o << "token " << static_cast<std::int64_t>(i) / k << " slot " << static_cast<std::int64_t>(i) % k
        << ": want (expert " << want.experts[i] << ", weight " << want.weights[i] << ", "
        << status_name(want.status[i]) << "), got (expert " << got.experts[i] << ", weight " << got.weights[i]
        << ", " << status_name(got.status[i]) << ")";
      return o.str();
    }
  }
  if (want.dropped != got.dropped || want.rerouted != got.rerouted) {
    return "counts: want dropped " + std::to_string(want.dropped) + " rerouted " +
           std::to_string(want.rerouted) + ", got dropped " + std::to_string(got.dropped) + " rerouted " +
           std::to_string(got.rerouted);
  }
  return {};
}

std::string check_invariants(const Case& c, std::int64_t layer, const Outcome& o) {
  const LayerInput& in = c.layers[static_cast<std::size_t>(layer)];
  const std::int64_t k = c.k;
  const CapacityConfig& cfg = c.config;
  const auto slot = [&](std::int64_t t, std::int64_t s) { return static_cast<std::size_t>(t * k + s); };
  const auto where = [&](std::int64_t t, std::int64_t s) {
    return "layer " + std::to_string(layer) + " token " + std::to_string(t) + " slot " + std::to_string(s) +
           ": ";
  };
  const auto exempt = [&](std::int64_t t) {
    return !c.exempt.empty() && c.exempt[static_cast<std::size_t>(t)] != 0;
  };

  std::int64_t dropped = 0;
  std::int64_t rerouted = 0;
  for (const SlotStatus s : o.status) {
    dropped += s == SlotStatus::dropped ? 1 : 0;
    rerouted += s == SlotStatus::rerouted ? 1 : 0;
  }
  if (dropped != o.dropped || rerouted != o.rerouted)
    return "returned counts (dropped " + std::to_string(o.dropped) + ", rerouted " +
           std::to_string(o.rerouted) + ") disagree with the statuses (" + std::to_string(dropped) + ", " +
           std::to_string(rerouted) + ")";

  if (!cfg.active(layer)) {
    if (o.experts != in.experts ||
        !std::equal(o.weights.begin(), o.weights.end(), in.weights.begin(), in.weights.end(),
                    [](float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }))
      return "inactive layer changed the routing";
    if (dropped + rerouted != 0) return "inactive layer reports drops or reroutes";
    return {};
  }

  const std::vector<int> home = homes(c);
  const bool rerouting = cfg.policy == CapacityPolicy::reroute || cfg.policy == CapacityPolicy::expanded;
  for (std::int64_t t = 0; t < c.T; ++t) {
    bool lost = false;
    float original_sum = 0.0F;
    float final_sum = 0.0F;
    for (std::int64_t s = 0; s < k; ++s) {
      const std::size_t i = slot(t, s);
      const std::int32_t e = o.experts[i];
      original_sum += in.weights[i];
      final_sum += o.weights[i];
      if (exempt(t) && o.status[i] != SlotStatus::kept) return where(t, s) + "exempt token lost its slot";
      if (e >= 0 && std::count(o.experts.begin() + t * k, o.experts.begin() + (t + 1) * k, e) != 1)
        return where(t, s) + "expert " + std::to_string(e) + " twice in one token";
      switch (o.status[i]) {
        case SlotStatus::kept:
          if (e != in.experts[i]) return where(t, s) + "kept slot changed its expert";
          if (!cfg.renormalize_after_drop && std::memcmp(&o.weights[i], &in.weights[i], sizeof(float)) != 0)
            return where(t, s) + "kept slot changed its weight";
          break;
        case SlotStatus::dropped:
          lost = true;
          if (e != -1 || o.weights[i] != 0.0F)
            return where(t, s) + "dropped slot keeps an expert or a weight";
          break;
        case SlotStatus::rerouted: {
          if (!rerouting) return where(t, s) + "rerouted under a drop-only policy";
          if (e < 0 || e >= c.E) return where(t, s) + "rerouted to no expert";
          if (in_token(in.experts.data() + t * k, k, e))
            return where(t, s) + "rerouted to an expert the token had chosen";
          if (cfg.policy == CapacityPolicy::expanded) {
            if (c.placement->owners(layer)[static_cast<std::size_t>(e)] != home[static_cast<std::size_t>(t)])
              return where(t, s) + "expanded reroute to expert " + std::to_string(e) +
                     " off the token's rank";
            const std::vector<std::int32_t> f =
                expanded_fallbacks(c, layer, t, home[static_cast<std::size_t>(t)]);
            if (std::find(f.begin(), f.end(), e) == f.end())
              return where(t, s) + "expanded reroute to expert " + std::to_string(e) +
                     ", not among the token's m most probable local experts";
          }
          const float w = reroute_weight(c, layer, t, e);
          if (!cfg.renormalize_after_drop && std::memcmp(&w, &o.weights[i], sizeof(float)) != 0)
            return where(t, s) + "rerouted weight " + std::to_string(o.weights[i]) + ", want " +
                   std::to_string(w);
          break;
        }
      }
    }
    if (cfg.renormalize_after_drop && lost && final_sum > 0 &&
        std::fabs(final_sum - original_sum) > 2e-6F * std::max(1.0F, original_sum))
      return "token " + std::to_string(t) + ": renormalized weights sum to " + std::to_string(final_sum) +
             ", the original to " + std::to_string(original_sum);
  }

  // Capacity per bin and scope group; exact drop counts; kept = top-C.
  for (const std::vector<std::int64_t>& group : scope_groups(c)) {
    const auto G = static_cast<std::int64_t>(group.size());
    const Bins bins = make_bins(c, layer, G);
    std::vector<std::int64_t> load(static_cast<std::size_t>(bins.count), 0);
    std::vector<std::int64_t> exempt_load(static_cast<std::size_t>(bins.count), 0);
    std::vector<std::int64_t> candidates(static_cast<std::size_t>(bins.count), 0);
    std::int64_t lost = 0;
    std::vector<std::vector<Contender>> kept(static_cast<std::size_t>(bins.count));
    std::vector<std::vector<Contender>> gone(static_cast<std::size_t>(bins.count));
    for (std::int64_t pos = 0; pos < G; ++pos) {
      const std::int64_t t = group[static_cast<std::size_t>(pos)];
      for (std::int64_t s = 0; s < k; ++s) {
        const std::size_t i = slot(t, s);
        const auto b0 = static_cast<std::size_t>(bins.of_expert[static_cast<std::size_t>(in.experts[i])]);
        if (exempt(t)) {
          ++exempt_load[b0];
        } else {
          ++candidates[b0];
          const Contender x{t, s, pos, in.weights[i], in.experts[i]};
          (o.status[i] == SlotStatus::kept ? kept[b0] : gone[b0]).push_back(x);
        }
        if (o.status[i] != SlotStatus::kept) ++lost;
        if (o.experts[i] >= 0)
          ++load[static_cast<std::size_t>(bins.of_expert[static_cast<std::size_t>(o.experts[i])])];
      }
    }
    std::int64_t must_lose = 0;
    for (std::size_t b = 0; b < load.size(); ++b) {
      const std::int64_t cap = bins.capacity[b];
      const std::int64_t cand_cap = std::max<std::int64_t>(0, cap - exempt_load[b]);
      must_lose += std::max<std::int64_t>(0, candidates[b] - cand_cap);
      if (load[b] > std::max(cap, exempt_load[b]))
        return "bin " + std::to_string(b) + " holds " + std::to_string(load[b]) + " assignments, capacity " +
               std::to_string(cap) + " (exempt " + std::to_string(exempt_load[b]) + ", scope tokens " +
               std::to_string(G) + ")";
      if (exempt_load[b] >= cap && load[b] != exempt_load[b])
        return "bin " + std::to_string(b) + " is full with exempt tokens but took others";
      if (static_cast<std::int64_t>(kept[b].size()) != std::min(candidates[b], cand_cap))
        return "bin " + std::to_string(b) + " kept " + std::to_string(kept[b].size()) + " of its " +
               std::to_string(candidates[b]) + " own assignments, want " +
               std::to_string(std::min(candidates[b], cand_cap)) + " (capacity " + std::to_string(cap) +
               ", exempt " + std::to_string(exempt_load[b]) + ")";
      if (cfg.score != DropScore::random) {
        for (const Contender& x : gone[b]) {
          for (const Contender& y : kept[b]) {
            if (outranks(cfg.score, x, y))
              return "bin " + std::to_string(b) + ": token " + std::to_string(x.t) + " slot " +
                     std::to_string(x.s) + " lost, yet token " + std::to_string(y.t) + " slot " +
                     std::to_string(y.s) + " with a lower score was kept";
          }
        }
      }
    }
    if (lost != must_lose)
      return "scope group: " + std::to_string(lost) + " slots dropped or rerouted, want exactly " +
             std::to_string(must_lose) + " = sum(max(0, N_i - C))";
  }
  return {};
}

// Every slot kept by `drop` is kept by `more`; every slot `less` rerouted, `more` rerouted the same way.
std::string check_extends(const Outcome& less, const Outcome& more, std::int64_t k) {
  for (std::size_t i = 0; i < less.status.size(); ++i) {
    const bool fine = less.status[i] == SlotStatus::dropped ||
                      (less.status[i] == more.status[i] && less.experts[i] == more.experts[i]);
    if (!fine)
      return "token " + std::to_string(static_cast<std::int64_t>(i) / k) + " slot " +
             std::to_string(static_cast<std::int64_t>(i) % k) + ": " + status_name(less.status[i]) + " to " +
             std::to_string(less.experts[i]) + " before, " + status_name(more.status[i]) + " to " +
             std::to_string(more.experts[i]) + " with more reroute freedom";
  }
  return {};
}

// Runs the implementation and checks it against the reference and the invariants.
void expect_matches_reference(const Case& c, Transport transport = Transport::automatic) {
  const std::vector<Outcome> got = run_impl(c, transport);
  for (std::size_t l = 0; l < c.layers.size(); ++l) {
    const auto layer = static_cast<std::int64_t>(l);
    const std::string bad = check_invariants(c, layer, got[l]);
    EXPECT_TRUE(bad.empty()) << describe_case(c) << "\n" << bad;
    if (const std::optional<Outcome> want = reference(c, layer)) {
      const std::string diff = compare(*want, got[l], c.k, c.config.renormalize_after_drop);
      EXPECT_TRUE(diff.empty()) << describe_case(c) << "\nlayer " << l << ": " << diff;
    }
  }
}

CapacityConfig config(double gamma, CapacityPolicy policy = CapacityPolicy::drop,
                      CapacityGranularity granularity = CapacityGranularity::expert,
                      DropScore score = DropScore::gate, CapacityScope scope = CapacityScope::global) {
  CapacityConfig c;
  c.gamma = {gamma};
  c.policy = policy;
  c.granularity = granularity;
  c.score = score;
  c.scope = scope;
  return c;
}

// Probabilities where every token prefers experts in the same order 0 > 1 > ... (E-1), all tokens alike.
std::vector<float> same_preferences(std::int64_t T, std::int64_t E) {
  std::vector<float> raw(static_cast<std::size_t>(T * E));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) raw[static_cast<std::size_t>(t * E + e)] = static_cast<float>(E - e);
  return normalize_rows(raw, T, E);
}

std::vector<float> random_probs(std::mt19937_64& rng, std::int64_t T, std::int64_t E) {
  std::uniform_real_distribution<float> u(0.01F, 1.0F);
  std::vector<float> raw(static_cast<std::size_t>(T * E));
  for (float& x : raw) x = u(rng);
  return normalize_rows(raw, T, E);
}

// ---------------------------------------------------------------------------------------------------------
// gamma = inf / policy none.

TEST(CapacityStage, InfiniteGammaIsBitIdenticalAndSilent) {
  std::mt19937_64 rng(1);
  for (const CapacityPolicy policy :
       {CapacityPolicy::drop, CapacityPolicy::reroute, CapacityPolicy::expanded, CapacityPolicy::none}) {
    for (const CapacityScope scope : {CapacityScope::global, CapacityScope::local}) {
      // policy none with a finite gamma is just as inactive as gamma = inf.
      const double gamma = policy == CapacityPolicy::none ? 0.25 : kInf;
      CapacityConfig cfg = config(gamma, policy, CapacityGranularity::device, DropScore::gate, scope);
      cfg.renormalize_after_drop = true;
      EXPECT_FALSE(cfg.active(0));
      const std::int64_t T = 9;
      const std::int64_t E = 6;
      const std::int64_t k = 3;
      std::vector<float> probs = random_probs(rng, T, E);
      // NaN-free but awkward weights: zeros and negative zeros must survive bit for bit.
      Case c = make_case(cfg, T, E, k, {probs, probs}, ExpertPlacement::contiguous(2, E, 4), {2, 0, 3, 4},
                         true, 2.5F);
      c.layers[0].weights[0] = -0.0F;
      c.layers[1].weights[4] = 0.0F;
      // SilentCommunicator for every rank: a collective would throw.
      std::vector<Outcome> got;
      ASSERT_NO_THROW(got = run_impl(c)) << describe_case(c);
      for (std::size_t l = 0; l < 2; ++l) {
        EXPECT_EQ(got[l].experts, c.layers[l].experts);
        EXPECT_EQ(std::memcmp(got[l].weights.data(), c.layers[l].weights.data(), got[l].weights.size() * 4),
                  0);
        for (const SlotStatus s : got[l].status) EXPECT_EQ(s, SlotStatus::kept);
        EXPECT_EQ(got[l].dropped, 0);
        EXPECT_EQ(got[l].rerouted, 0);
      }
    }
  }
}

TEST(CapacityStage, InfiniteLayerOfAPerLayerGammaIsUntouched) {
  CapacityConfig cfg = config(1.0);
  cfg.gamma = {0.5, kInf};
  const std::int64_t T = 12;
  const std::int64_t E = 4;
  const std::vector<float> probs = same_preferences(T, E);
  Case c = make_case(cfg, T, E, 1, {probs, probs}, ExpertPlacement::contiguous(2, E, 2), {5, 7});
  const std::vector<Outcome> got = run_impl(c, Transport::threads);
  EXPECT_EQ(got[0].dropped, T - 2);  // C = ceil(0.5 * 12 / 4) = 2, everyone on expert 0
  EXPECT_EQ(got[1].experts, c.layers[1].experts);
  EXPECT_EQ(got[1].dropped, 0);
  expect_matches_reference(c, Transport::threads);
}

// ---------------------------------------------------------------------------------------------------------
// Drop, expert granularity.

TEST(CapacityStage, DropKeepsTheHighestGateWeights) {
  // 8 tokens, E = 4, k = 1: C = ceil(1 * 8 / 4) = 2. Tokens 0..5 pick expert 0 with rising probability.
  const std::int64_t T = 8;
  const std::int64_t E = 4;
  std::vector<float> raw(static_cast<std::size_t>(T * E), 1.0F);
  for (std::int64_t t = 0; t < 6; ++t) raw[static_cast<std::size_t>(t * E)] = 2.0F + static_cast<float>(t);
  raw[6 * E + 1] = 5.0F;
  raw[7 * E + 2] = 5.0F;
  Case c = make_case(config(1.0), T, E, 1, {normalize_rows(raw, T, E)}, ExpertPlacement::contiguous(1, E, 1));
  const Outcome got = run_impl(c)[0];
  EXPECT_EQ(got.dropped, 4);
  for (std::int64_t t = 0; t < 6; ++t) {
    EXPECT_EQ(got.status[static_cast<std::size_t>(t)], t >= 4 ? SlotStatus::kept : SlotStatus::dropped) << t;
    EXPECT_EQ(got.experts[static_cast<std::size_t>(t)], t >= 4 ? 0 : -1) << t;
  }
  EXPECT_EQ(got.experts[6], 1);
  EXPECT_EQ(got.experts[7], 2);
  expect_matches_reference(c);
}

TEST(CapacityStage, ExactTiesKeepExactlyCByTokenPosition) {
  // Every token has the same probabilities, so every assignment of an expert ties: the reference code of the
  // paper dropped all of them. C = ceil(gamma * T * k / E).
  for (const double gamma : {0.25, 0.5, 1.0, 1.5}) {
    for (const std::int64_t k : {1, 2, 3}) {
      const std::int64_t T = 37;
      const std::int64_t E = 8;
      Case c = make_case(config(gamma), T, E, k, {same_preferences(T, E)},
                         ExpertPlacement::contiguous(1, E, 1), {}, true);
      const std::int64_t C = exact_capacity(gamma, T, k, E, 1);
      const Outcome got = run_impl(c)[0];
      EXPECT_EQ(got.dropped, k * std::max<std::int64_t>(0, T - C)) << gamma << " " << k;
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t s = 0; s < k; ++s) {
          EXPECT_EQ(got.status[static_cast<std::size_t>(t * k + s)],
                    t < C ? SlotStatus::kept : SlotStatus::dropped)
              << "gamma " << gamma << " k " << k << " token " << t;
        }
      }
      expect_matches_reference(c);
    }
  }
}

TEST(CapacityStage, GateTiesWithinOneDeviceGoToTheEarlierSlot) {
  // Device granularity, one rank, k = 2 with equal weights: both slots of a token compete in the same bin;
  // C_dev = ceil(0.5 * 5 * 2) = 5 keeps tokens 0, 1 entirely and token 2's first slot.
  const std::int64_t T = 5;
  const std::int64_t E = 2;
  std::vector<float> probs(static_cast<std::size_t>(T * E), 0.5F);
  Case c = make_case(config(0.5, CapacityPolicy::drop, CapacityGranularity::device), T, E, 2, {probs},
                     ExpertPlacement::contiguous(1, E, 1));
  const Outcome got = run_impl(c)[0];
  const std::vector<SlotStatus> want = {SlotStatus::kept,    SlotStatus::kept,    SlotStatus::kept,
                                        SlotStatus::kept,    SlotStatus::kept,    SlotStatus::dropped,
                                        SlotStatus::dropped, SlotStatus::dropped, SlotStatus::dropped,
                                        SlotStatus::dropped};
  EXPECT_EQ(got.status, want);
  expect_matches_reference(c);
}

TEST(CapacityStage, OrderScoresKeepEarliestOrLatestTokens) {
  const std::int64_t T = 20;
  const std::int64_t E = 4;
  std::mt19937_64 rng(7);
  const std::vector<float> probs = random_probs(rng, T, E);
  for (const DropScore score : {DropScore::order, DropScore::reverse_order}) {
    // Split over 3 ranks (one empty): positions are global.
    Case c = make_case(config(0.5, CapacityPolicy::drop, CapacityGranularity::expert, score), T, E, 2,
                       {probs}, ExpertPlacement::contiguous(1, E, 3), {8, 0, 12});
    const Outcome got = run_impl(c)[0];
    const std::int64_t C = exact_capacity(0.5, T, 2, E, 1);  // 5
    for (std::int32_t e = 0; e < E; ++e) {
      std::vector<std::int64_t> tokens;  // tokens choosing e, in order
      for (std::int64_t t = 0; t < T; ++t)
        if (in_token(c.layers[0].experts.data() + t * 2, 2, e)) tokens.push_back(t);
      if (score == DropScore::reverse_order) std::reverse(tokens.begin(), tokens.end());
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        const bool kept = in_token(got.experts.data() + tokens[i] * 2, 2, e);
        EXPECT_EQ(kept, static_cast<std::int64_t>(i) < C)
            << to_string(score) << " expert " << e << " token " << tokens[i];
      }
    }
    expect_matches_reference(c);
  }
}

TEST(CapacityStage, RandomScoreIsSeeded) {
  const std::int64_t T = 200;
  const std::int64_t E = 4;
  const std::vector<float> probs = same_preferences(T, E);
  const auto run_seed = [&](std::uint64_t seed, std::vector<std::int64_t> split) {
    CapacityConfig cfg = config(0.5, CapacityPolicy::drop, CapacityGranularity::expert, DropScore::random);
    cfg.seed = seed;
    Case c = make_case(cfg, T, E, 1, {probs},
                       ExpertPlacement::contiguous(1, E, static_cast<int>(split.size())), split);
    const Outcome o = run_impl(c)[0];
    EXPECT_TRUE(check_invariants(c, 0, o).empty()) << check_invariants(c, 0, o);
    return o;
  };
  const Outcome a = run_seed(11, {200});
  const Outcome b = run_seed(11, {200});
  const Outcome d = run_seed(12, {200});
  EXPECT_EQ(a.experts, b.experts);
  EXPECT_EQ(a.dropped, 200 - 25);
  EXPECT_NE(a.experts, d.experts);
  // Not the order score in disguise: some kept token comes after some dropped one.
  bool shuffled = false;
  for (std::int64_t t = 1; t < T; ++t)
    shuffled = shuffled || (a.experts[static_cast<std::size_t>(t)] == 0 &&
                            a.experts[static_cast<std::size_t>(t - 1)] == -1);
  EXPECT_TRUE(shuffled);
  // Global scope: the same kept set over any split.
  EXPECT_EQ(run_seed(11, {50, 0, 101, 49}).experts, a.experts);
  EXPECT_EQ(run_seed(12, {0, 200}).experts, d.experts);
}

// ---------------------------------------------------------------------------------------------------------
// Device granularity.

TEST(CapacityStage, DeviceCapacityOnUnevenPlacements) {
  // 10 experts on 4 ranks: contiguous hosts 3, 3, 2, 2; C_dev = ceil(gamma * T * k / E * n_local).
  std::mt19937_64 rng(3);
  for (const char* kind : {"contiguous", "round-robin"}) {
    for (const double gamma : {0.5, 0.75, 1.0, 1.25}) {
      for (const DropScore score : {DropScore::gate, DropScore::order, DropScore::reverse_order}) {
        const std::int64_t T = 23;
        const std::int64_t E = 10;
        const std::int64_t k = 3;
        // Skewed: experts 0..2 (rank 0 in contiguous) are popular.
        std::vector<float> raw(static_cast<std::size_t>(T * E));
        std::uniform_real_distribution<float> u(0.0F, 1.0F);
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t e = 0; e < E; ++e)
            raw[static_cast<std::size_t>(t * E + e)] = u(rng) + (e < 3 ? 1.0F : 0.0F);
        Case c =
            make_case(config(gamma, CapacityPolicy::drop, CapacityGranularity::device, score), T, E, k,
                      {normalize_rows(raw, T, E)}, ExpertPlacement::from_spec(kind, 1, E, 4), {6, 0, 9, 8});
        const Outcome got = run_impl(c)[0];
        std::vector<std::int64_t> load(4, 0);
        for (const std::int32_t e : got.experts)
          if (e >= 0) ++load[static_cast<std::size_t>(c.placement->owners(0)[static_cast<std::size_t>(e)])];
        for (int r = 0; r < 4; ++r) {
          const auto n = static_cast<std::int64_t>(c.placement->local_experts(0, r).size());
          EXPECT_LE(load[static_cast<std::size_t>(r)], exact_capacity(gamma, T, k, E, n))
              << kind << " rank " << r;
        }
        expect_matches_reference(c);
      }
    }
  }
}

TEST(CapacityStage, DeviceCapacityIsExactWhereFloatingPointRoundsUp) {
  // C_dev = ceil(gamma * N_bar * n_local) with N_bar = T * k / E. Computed as gamma * (T*k/E) * n_local in
  // floating point, 0.25 * (84 / 19) * 19 = 21.000000000000004 and the ceiling lets 22 through, one more than
  // the 21 = 0.25 * 84 that the design allows.
  {
    const std::int64_t T = 12;
    const std::int64_t E = 19;
    const std::int64_t k = 7;
    std::mt19937_64 rng(5);
    Case c = make_case(config(0.25, CapacityPolicy::drop, CapacityGranularity::device), T, E, k,
                       {random_probs(rng, T, E)}, ExpertPlacement::contiguous(1, E, 1));
    const Outcome got = run_impl(c)[0];
    EXPECT_EQ(got.dropped, T * k - 21);
  }
  {
    // Two ranks of 11 experts: C_dev = 0.25 * 25 * 8 * 11 / 22 = 25 exactly (26 in the naive product).
    const std::int64_t T = 25;
    const std::int64_t E = 22;
    const std::int64_t k = 8;
    Case c = make_case(config(0.25, CapacityPolicy::drop, CapacityGranularity::device), T, E, k,
                       {same_preferences(T, E)}, ExpertPlacement::contiguous(1, E, 2), {10, 15});
    const Outcome got = run_impl(c)[0];
    std::int64_t kept_rank0 = 0;
    for (const std::int32_t e : got.experts) kept_rank0 += e >= 0 && e < 11 ? 1 : 0;
    EXPECT_EQ(kept_rank0, 25);  // every token's 8 experts are 0..7, all on rank 0
    expect_matches_reference(c);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Reroute.

TEST(CapacityStage, RerouteRoundsFillFreeCapacityWithoutDisplacing) {
  // 8 tokens all prefer 0 > 1 > 2 > 3, k = 1, C = 2 per expert. Drop keeps 2 on expert 0; each round moves 2
  // more tokens one expert further.
  const std::int64_t T = 8;
  const std::int64_t E = 4;
  for (const std::int64_t rounds : {1, 2, 3, 4}) {
    CapacityConfig cfg = config(1.0, CapacityPolicy::reroute);
    cfg.rounds = rounds;
    Case c = make_case(cfg, T, E, 1, {same_preferences(T, E)}, ExpertPlacement::contiguous(1, E, 2), {3, 5});
    const Outcome got = run_impl(c)[0];
    const std::int64_t moved = 2 * std::min<std::int64_t>(rounds, 3);
    EXPECT_EQ(got.rerouted, moved) << rounds;
    EXPECT_EQ(got.dropped, 6 - moved) << rounds;
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int32_t want = t < 2 + moved ? static_cast<std::int32_t>(t / 2) : -1;
      EXPECT_EQ(got.experts[static_cast<std::size_t>(t)], want) << "rounds " << rounds << " token " << t;
    }
    expect_matches_reference(c);
  }
}

TEST(CapacityStage, MoreRoundsNeverRerouteFewer) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 40; ++trial) {
    const std::int64_t T = 30;
    const std::int64_t E = 6;
    const std::int64_t k = 2;
    std::vector<float> raw(static_cast<std::size_t>(T * E));
    std::uniform_real_distribution<float> u(0.0F, 1.0F);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t e = 0; e < E; ++e)
        raw[static_cast<std::size_t>(t * E + e)] = u(rng) * static_cast<float>(E - e);  // skewed to low ids
    const std::vector<float> probs = normalize_rows(raw, T, E);
    std::vector<Outcome> by_rounds;
    for (const std::int64_t rounds : {1, 2, 3}) {
      CapacityConfig cfg = config(trial % 2 ? 1.0 : 1.25, CapacityPolicy::reroute,
                                  trial % 3 ? CapacityGranularity::expert : CapacityGranularity::device);
      cfg.rounds = rounds;
      Case c = make_case(cfg, T, E, k, {probs}, ExpertPlacement::round_robin(1, E, 3), {10, 10, 10}, true);
      by_rounds.push_back(run_impl(c)[0]);
      expect_matches_reference(c);
      cfg.policy = CapacityPolicy::drop;
      Case d = make_case(cfg, T, E, k, {probs}, ExpertPlacement::round_robin(1, E, 3), {10, 10, 10}, true);
      const std::string bad = check_extends(run_impl(d)[0], by_rounds.back(), k);
      EXPECT_TRUE(bad.empty()) << "drop vs reroute: " << bad;
    }
    for (std::size_t i = 1; i < by_rounds.size(); ++i) {
      EXPECT_GE(by_rounds[i].rerouted, by_rounds[i - 1].rerouted);
      const std::string bad = check_extends(by_rounds[i - 1], by_rounds[i], k);
      EXPECT_TRUE(bad.empty()) << "rounds " << i << " vs " << i + 1 << ": " << bad;
    }
  }
}

TEST(CapacityStage, RerouteWeightFollowsTheModelsNormalization) {
  // Tokens 0..3 all want experts 0 and 1 (k = 2) with the same probabilities there; E = 4, T = 4,
  // gamma = 0.5: C = 1 per expert. Token 0 keeps both (tie: earlier token). Round 1: token 1 bids for 2
  // (2/15) and 3 (1/15); tokens 2 and 3 for 2 and 3 (1.5/15 each). Expert 2 goes to token 1, expert 3 to
  // token 2. The weight is the new expert's probability over the sum of the ORIGINAL top-2 probabilities,
  // times the scaling factor.
  const std::int64_t T = 4;
  const std::int64_t E = 4;
  std::vector<float> raw = {8, 4, 2, 1, 8, 4, 2, 1, 8, 4, 1.5F, 1.5F, 8, 4, 1.5F, 1.5F};
  const std::vector<float> probs = normalize_rows(raw, T, E);
  for (const bool normalized : {false, true}) {
    for (const float scaling : {1.0F, 2.5F}) {
      CapacityConfig cfg = config(0.5, CapacityPolicy::reroute);
      cfg.rounds = 2;
      Case c =
          make_case(cfg, T, E, 2, {probs}, ExpertPlacement::contiguous(1, E, 1), {}, normalized, scaling);
      const Outcome got = run_impl(c)[0];
      EXPECT_EQ(got.experts, (std::vector<std::int32_t>{0, 1, 2, -1, -1, 3, -1, -1}));
      const std::vector<SlotStatus> want = {SlotStatus::kept,    SlotStatus::kept,    SlotStatus::rerouted,
                                            SlotStatus::dropped, SlotStatus::dropped, SlotStatus::rerouted,
                                            SlotStatus::dropped, SlotStatus::dropped};
      EXPECT_EQ(got.status, want);
      const float p = 15.0F;
      EXPECT_NEAR(got.weights[2], (normalized ? (2.0F / p) / (12.0F / p) : 2.0F / p) * scaling, 1e-6F);
      EXPECT_NEAR(got.weights[5], (normalized ? (1.5F / p) / (12.0F / p) : 1.5F / p) * scaling, 1e-6F);
      EXPECT_EQ(got.weights[2], (normalized ? probs[6] / (probs[4] + probs[5]) : probs[6]) * scaling);
      EXPECT_EQ(got.weights[5], (normalized ? probs[11] / (probs[8] + probs[9]) : probs[11]) * scaling);
      expect_matches_reference(c);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Expanded drop.

TEST(CapacityStage, ExpandedReroutesOnlyToTheTokensOwnRank) {
  // 8 experts on 2 ranks (0-3, 4-7). Every token prefers 0 > 1 > 2 > ... > 7: a free reroute would go to 1,
  // 2, 3; expanded must go to the token's own rank: rank 0's tokens to 2 or 3 (outside top-k {0, 1}), rank
  // 1's to 4, 5, ... by probability.
  const std::int64_t T = 16;
  const std::int64_t E = 8;
  const std::int64_t k = 2;
  for (const std::int64_t m : {1, 2, 3}) {
    for (const std::int64_t rounds : {1, 3}) {
      CapacityConfig cfg = config(1.0, CapacityPolicy::expanded);
      cfg.local_experts = m;
      cfg.rounds = rounds;
      Case c =
          make_case(cfg, T, E, k, {same_preferences(T, E)}, ExpertPlacement::contiguous(1, E, 2), {6, 10});
      const Outcome got = run_impl(c)[0];
      // C = ceil(16 * 2 / 8) = 4 per expert.
      std::vector<std::int64_t> load(E, 0);
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t s = 0; s < k; ++s) {
          const std::int32_t e = got.experts[static_cast<std::size_t>(t * k + s)];
          if (e >= 0) ++load[static_cast<std::size_t>(e)];
          if (got.status[static_cast<std::size_t>(t * k + s)] != SlotStatus::rerouted) continue;
          const int home = t < 6 ? 0 : 1;
          EXPECT_EQ(c.placement->owners(0)[static_cast<std::size_t>(e)], home) << "m " << m << " token " << t;
          // Among the m most probable local experts outside the top-k.
          const std::int32_t first = home == 0 ? 2 : 4;
          const std::int32_t last = home == 0 ? 3 : 7;
          EXPECT_GE(e, first);
          EXPECT_LE(e, std::min<std::int32_t>(last, first + static_cast<std::int32_t>(m) - 1));
        }
      }
      for (std::int64_t e = 0; e < E; ++e) EXPECT_LE(load[static_cast<std::size_t>(e)], 4);
      expect_matches_reference(c);
    }
  }
}

TEST(CapacityStage, ExpandedLeavesATokenDroppedWhenItsLocalFallbacksAreFull) {
  // Rank 1 hosts experts 2, 3 (E = 4, 2 ranks); m = 1: a rank-1 token's only fallback is expert 2 (its
  // top-1 is 0). Expert 2 fills up; expert 1 and 3 have room, yet expanded must not use them.
  const std::int64_t T = 8;
  const std::int64_t E = 4;
  CapacityConfig cfg = config(1.0, CapacityPolicy::expanded);
  cfg.local_experts = 1;
  cfg.rounds = 3;
  Case c = make_case(cfg, T, E, 1, {same_preferences(T, E)}, ExpertPlacement::contiguous(1, E, 2), {0, 8});
  const Outcome got = run_impl(c)[0];
  EXPECT_EQ(got.rerouted, 2);  // C = 2: two tokens move to expert 2
  EXPECT_EQ(got.dropped, 4);
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int32_t e = got.experts[static_cast<std::size_t>(t)];
    EXPECT_TRUE(e == 0 || e == 2 || e == -1) << "token " << t << " went to " << e;
  }
  expect_matches_reference(c);
}

// ---------------------------------------------------------------------------------------------------------
// Exempt rows, renormalization.

TEST(CapacityStage, ExemptRowsAreNeverDroppedButUseCapacity) {
  const std::int64_t T = 8;
  const std::int64_t E = 4;
  // C = 2 on every expert; all tokens want expert 0.
  for (const CapacityPolicy policy : {CapacityPolicy::drop, CapacityPolicy::reroute}) {
    Case c = make_case(config(1.0, policy), T, E, 1, {same_preferences(T, E)},
                       ExpertPlacement::contiguous(1, E, 2), {4, 4});
    c.exempt = {0, 0, 1, 0, 0, 1, 1, 0};  // three exempt tokens > C
    const Outcome got = run_impl(c)[0];
    for (std::int64_t t = 0; t < T; ++t) {
      if (c.exempt[static_cast<std::size_t>(t)] != 0) {
        EXPECT_EQ(got.experts[static_cast<std::size_t>(t)], 0) << t;
      } else {
        EXPECT_NE(got.experts[static_cast<std::size_t>(t)], 0)
            << t;  // expert 0 is over-full with exempt rows
      }
    }
    expect_matches_reference(c);
    c.exempt = {0, 1, 0, 0, 0, 0, 0, 0};  // one exempt: one more of the others fits, the earliest
    const Outcome one = run_impl(c)[0];
    EXPECT_EQ(one.experts[0], 0);
    EXPECT_EQ(one.experts[1], 0);
    for (std::int64_t t = 2; t < T; ++t) EXPECT_NE(one.experts[static_cast<std::size_t>(t)], 0) << t;
    expect_matches_reference(c);
  }
}

TEST(CapacityStage, RenormalizeAfterDropRestoresEachTokensWeightSum) {
  std::mt19937_64 rng(23);
  for (const bool normalized : {false, true}) {
    for (const CapacityPolicy policy : {CapacityPolicy::drop, CapacityPolicy::reroute}) {
      const std::int64_t T = 40;
      const std::int64_t E = 6;
      const std::int64_t k = 3;
      CapacityConfig cfg = config(0.5, policy);
      cfg.renormalize_after_drop = true;
      Case c = make_case(cfg, T, E, k, {random_probs(rng, T, E)}, ExpertPlacement::contiguous(1, E, 2),
                         {13, 27}, normalized, 1.5F);
      const Outcome got = run_impl(c)[0];
      std::int64_t renormalized = 0;
      for (std::int64_t t = 0; t < T; ++t) {
        float before = 0.0F;
        float after = 0.0F;
        bool lost = false;
        for (std::int64_t s = 0; s < k; ++s) {
          const auto i = static_cast<std::size_t>(t * k + s);
          before += c.layers[0].weights[i];
          after += got.weights[i];
          lost = lost || got.status[i] == SlotStatus::dropped;
        }
        if (lost && after > 0) {
          ++renormalized;
          EXPECT_NEAR(after, before, 1e-6F * before) << "token " << t;
        }
      }
      EXPECT_GT(renormalized, 0);
      expect_matches_reference(c);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Scope.

TEST(CapacityStage, LocalScopeEnforcesEachRanksOwnCapacityWithoutCommunication) {
  std::mt19937_64 rng(29);
  for (const CapacityPolicy policy :
       {CapacityPolicy::drop, CapacityPolicy::reroute, CapacityPolicy::expanded}) {
    for (const CapacityGranularity g : {CapacityGranularity::expert, CapacityGranularity::device}) {
      for (const DropScore score :
           {DropScore::gate, DropScore::order, DropScore::reverse_order, DropScore::random}) {
        const std::int64_t T = 31;
        const std::int64_t E = 10;
        const std::int64_t k = 2;
        CapacityConfig cfg = config(0.75, policy, g, score, CapacityScope::local);
        cfg.rounds = 2;
        Case c = make_case(cfg, T, E, k, {same_preferences(T, E), random_probs(rng, T, E)},
                           ExpertPlacement::contiguous(2, E, 4), {11, 0, 3, 17});
        // Silent communicators: any collective throws.
        std::vector<Outcome> silent;
        ASSERT_NO_THROW(silent = run_impl(c)) << describe_case(c);
        // A real group gives the same, and each rank alone (as the single rank of its own step) agrees with
        // the per-rank capacities.
        const std::vector<Outcome> threads = run_impl(c, Transport::threads);
        for (std::size_t l = 0; l < 2; ++l) {
          EXPECT_TRUE(compare(silent[l], threads[l], k, false).empty())
              << compare(silent[l], threads[l], k, false);
          const std::string bad = check_invariants(c, static_cast<std::int64_t>(l), silent[l]);
          EXPECT_TRUE(bad.empty()) << describe_case(c) << "\n" << bad;
        }
        expect_matches_reference(c);
      }
    }
  }
}

TEST(CapacityStage, LocalScopeUsesEachRanksTokenCount) {
  // Rank 0: 4 tokens, rank 1: 12 tokens, E = 4, k = 1, gamma = 1, all on expert 0: C_0 = 1, C_1 = 3.
  Case c = make_case(
      config(1.0, CapacityPolicy::drop, CapacityGranularity::expert, DropScore::gate, CapacityScope::local),
      16, 4, 1, {same_preferences(16, 4)}, ExpertPlacement::contiguous(1, 4, 2), {4, 12});
  const Outcome got = run_impl(c)[0];
  std::vector<std::int32_t> want(16, -1);
  want[0] = 0;
  want[4] = want[5] = want[6] = 0;
  EXPECT_EQ(got.experts, want);
}

// Global scope over every split of the same tokens: identical to one process.
TEST(CapacityStage, GlobalScopeIsIndependentOfTheSplit) {
  std::mt19937_64 rng(31);
  const std::int64_t T = 27;
  const std::int64_t E = 10;
  const std::int64_t k = 3;
  const std::vector<std::vector<std::int64_t>> splits_by_np[] = {
      {{27}},
      {{27, 0}, {0, 27}, {13, 14}, {1, 26}},
      {{27, 0, 0}, {0, 0, 27}, {9, 0, 18}, {5, 11, 11}},
      {{27, 0, 0, 0}, {0, 27, 0, 0}, {3, 0, 20, 4}, {0, 9, 9, 9}, {7, 7, 7, 6}}};
  // Half the tokens identical (ties), half random.
  std::vector<float> probs = same_preferences(T, E);
  const std::vector<float> noise = random_probs(rng, T, E);
  std::copy(noise.begin() + (T / 2) * E, noise.end(), probs.begin() + (T / 2) * E);
  for (const CapacityPolicy policy :
       {CapacityPolicy::drop, CapacityPolicy::reroute, CapacityPolicy::expanded}) {
    for (const CapacityGranularity g : {CapacityGranularity::expert, CapacityGranularity::device}) {
      for (const DropScore score :
           {DropScore::gate, DropScore::order, DropScore::reverse_order, DropScore::random}) {
        for (const bool renormalize : {false, true}) {
          CapacityConfig cfg = config(0.75, policy, g, score);
          cfg.rounds = 2;
          cfg.local_experts = 2;
          cfg.seed = 99;
          cfg.renormalize_after_drop = renormalize;
          Case one = make_case(cfg, T, E, k, {probs}, ExpertPlacement::contiguous(1, E, 1), {}, true);
          const Outcome single = run_impl(one)[0];
          for (int np = 1; np <= 4; ++np) {
            std::optional<Outcome> first_split;
            for (const std::vector<std::int64_t>& split : splits_by_np[np - 1]) {
              Case c = make_case(cfg, T, E, k, {probs}, ExpertPlacement::round_robin(1, E, np), split, true);
              const Outcome got = run_impl(c)[0];
              const std::string bad = check_invariants(c, 0, got);
              EXPECT_TRUE(bad.empty()) << describe_case(c) << "\n" << bad;
              if (const std::optional<Outcome> want = reference(c, 0)) {
                const std::string diff = compare(*want, got, k, renormalize);
                EXPECT_TRUE(diff.empty()) << describe_case(c) << "\nvs reference: " << diff;
              }
              // Placement-independent configurations equal the single process bit for bit.
              if (g == CapacityGranularity::expert && policy != CapacityPolicy::expanded) {
                const std::string diff = compare(single, got, k, false);
                EXPECT_TRUE(diff.empty()) << describe_case(c) << "\nvs np=1: " << diff;
              }
              // With the same placement, any split gives the same (expanded depends on the tokens' ranks).
              if (policy != CapacityPolicy::expanded) {
                if (!first_split) first_split = got;
                const std::string diff = compare(*first_split, got, k, false);
                EXPECT_TRUE(diff.empty()) << describe_case(c) << "\nvs first split: " << diff;
              }
            }
          }
        }
      }
    }
  }
}

TEST(CapacityStage, ReusedAcrossStepsAndLayers) {
  // One scheduler per rank for many steps with changing token counts (some zero): every step equals a fresh
  // scheduler, and the reference.
  std::mt19937_64 rng(37);
  CapacityConfig cfg = config(0.75, CapacityPolicy::reroute, CapacityGranularity::device);
  cfg.gamma = {0.75, 1.25, 0.5};
  cfg.rounds = 2;
  const std::int64_t E = 10;
  const std::int64_t k = 2;
  const int np = 3;
  const auto placement = std::make_shared<const ExpertPlacement>(ExpertPlacement::contiguous(3, E, np));
  std::vector<Case> steps;
  for (int step = 0; step < 12; ++step) {
    std::vector<std::int64_t> split(np);
    std::int64_t T = 0;
    for (std::int64_t& n : split) {
      n = step % 4 == 3 ? 0 : static_cast<std::int64_t>(rng() % 17);
      T += n;
    }
    std::vector<std::vector<float>> probs;
    for (int l = 0; l < 3; ++l) probs.push_back(random_probs(rng, T, E));
    Case c = make_case(cfg, T, E, k, probs, ExpertPlacement::contiguous(3, E, np), split, true);
    c.placement = placement;
    steps.push_back(std::move(c));
  }
  std::vector<std::vector<Outcome>> reused(steps.size());
  std::mutex mutex;
  test::run_ranks(np, [&](Communicator& comm) {
    CapacityStage scheduler(cfg, comm);
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Case& c = steps[i];
      const auto r = static_cast<std::size_t>(comm.rank());
      const std::int64_t first = offsets_of(c.split)[r];
      const std::int64_t n = c.split[r];
      scheduler.begin_step(n);
      std::vector<Outcome> mine(3);
      for (std::int64_t l = 0; l < 3; ++l) {
        const LayerInput& in = c.layers[static_cast<std::size_t>(l)];
        Outcome& o = mine[static_cast<std::size_t>(l)];
        o.experts.assign(in.experts.begin() + first * k, in.experts.begin() + (first + n) * k);
        o.weights.assign(in.weights.begin() + first * k, in.weights.begin() + (first + n) * k);
        o.status.assign(static_cast<std::size_t>(n * k), SlotStatus::dropped);
        const testing::LayerCounts counts =
            testing::apply_layer(scheduler, l, *placement, comm.rank(), n, k,
                                 std::span<const float>(in.probs).subspan(static_cast<std::size_t>(first * E),
                                                                          static_cast<std::size_t>(n * E)),
                                 o.experts, o.weights, o.status, {}, true, 1.0F);
        o.dropped = counts.dropped;
        o.rerouted = counts.rerouted;
      }
      const std::lock_guard lock(mutex);
      if (reused[i].empty()) {
        reused[i].resize(3);
        for (std::size_t l = 0; l < 3; ++l) {
          reused[i][l].experts.resize(static_cast<std::size_t>(c.T * k));
          reused[i][l].weights.resize(static_cast<std::size_t>(c.T * k));
          reused[i][l].status.resize(static_cast<std::size_t>(c.T * k));
        }
      }
      for (std::size_t l = 0; l < 3; ++l) {
        std::copy(mine[l].experts.begin(), mine[l].experts.end(), reused[i][l].experts.begin() + first * k);
        std::copy(mine[l].weights.begin(), mine[l].weights.end(), reused[i][l].weights.begin() + first * k);
        std::copy(mine[l].status.begin(), mine[l].status.end(), reused[i][l].status.begin() + first * k);
        reused[i][l].dropped += mine[l].dropped;
        reused[i][l].rerouted += mine[l].rerouted;
      }
    }
  });
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const std::vector<Outcome> fresh = run_impl(steps[i], Transport::threads);
    for (std::size_t l = 0; l < 3; ++l) {
      EXPECT_TRUE(compare(fresh[l], reused[i][l], k, false).empty())
          << "step " << i << " layer " << l << ": " << compare(fresh[l], reused[i][l], k, false);
      const std::optional<Outcome> want = reference(steps[i], static_cast<std::int64_t>(l));
      EXPECT_TRUE(compare(*want, reused[i][l], k, false).empty()) << compare(*want, reused[i][l], k, false);
    }
  }
}

TEST(CapacityStage, RejectsAMismatchedPlacementOrTokenCount) {
  SelfCommunicator comm;
  CapacityStage scheduler(config(1.0), comm);
  const ExpertPlacement two_ranks = ExpertPlacement::contiguous(1, 4, 2);
  std::vector<float> probs(8, 0.25F);
  std::vector<std::int32_t> experts = {0, 1};
  std::vector<float> weights = {0.25F, 0.25F};
  std::vector<SlotStatus> status(2);
  const auto apply = [&](const ExpertPlacement& placement) {
    testing::apply_layer(scheduler, 0, placement, 0, 2, 1, probs, experts, weights, status, {}, false, 1.0F);
  };
  scheduler.begin_step(2);
  EXPECT_THROW(apply(two_ranks), std::invalid_argument);
  scheduler.begin_step(3);
  EXPECT_THROW(apply(ExpertPlacement::contiguous(1, 4, 1)), std::logic_error);
}

// ---------------------------------------------------------------------------------------------------------
// Property test: random routings, every invariant, the reference, and global-scope split invariance.

Case random_case(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto pick = [&](std::int64_t lo, std::int64_t hi) {  // inclusive
    return lo + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(hi - lo + 1));
  };
  static constexpr double kGammas[] = {0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0};
  Case c;
  c.generator_seed = seed;
  c.T = pick(0, 64);
  c.E = pick(2, 24);
  c.k = pick(1, std::min<std::int64_t>(c.E, 8));
  const int ranks = static_cast<int>(pick(1, 4));
  const std::int64_t num_layers = pick(1, 2);
  CapacityConfig& cfg = c.config;
  cfg.gamma = {kGammas[pick(0, 7)]};
  if (num_layers == 2 && pick(0, 2) == 0)
    cfg.gamma = {kGammas[pick(0, 7)], pick(0, 3) == 0 ? kInf : kGammas[pick(0, 7)]};
  if (pick(0, 49) == 0) cfg.gamma = {kInf};
  const std::int64_t p = pick(0, 30);
  cfg.policy = p == 0 ? CapacityPolicy::none
                      : (p <= 10 ? CapacityPolicy::drop
                                 : (p <= 20 ? CapacityPolicy::reroute : CapacityPolicy::expanded));
  cfg.granularity = pick(0, 1) ? CapacityGranularity::device : CapacityGranularity::expert;
  cfg.scope = pick(0, 1) ? CapacityScope::local : CapacityScope::global;
  cfg.score = static_cast<DropScore>(pick(0, 5) < 3 ? 0 : pick(1, 3));  // gate half the time
  cfg.rounds = pick(1, 3);
  cfg.local_experts = pick(1, 3);
  cfg.renormalize_after_drop = pick(0, 4) == 0;
  cfg.seed = rng();
  c.normalized = pick(0, 1) == 1;
  c.scaling = pick(0, 3) == 0 ? 2.5F : 1.0F;

  const std::int64_t kind = pick(0, 2);
  if (kind == 0) {
    c.placement =
        std::make_shared<const ExpertPlacement>(ExpertPlacement::contiguous(num_layers, c.E, ranks));
  } else if (kind == 1) {
    c.placement =
        std::make_shared<const ExpertPlacement>(ExpertPlacement::round_robin(num_layers, c.E, ranks));
  } else {
    std::vector<std::vector<double>> loads(static_cast<std::size_t>(num_layers));
    for (auto& l : loads)
      for (std::int64_t e = 0; e < c.E; ++e) l.push_back(static_cast<double>(pick(0, 100)));
    c.placement = std::make_shared<const ExpertPlacement>(ExpertPlacement::balanced(loads, c.E, ranks));
  }

  // Split: random cut points (ranks with zero tokens happen), sometimes all on one rank.
  std::vector<std::int64_t> cuts = {0, c.T};
  for (int r = 1; r < ranks; ++r) cuts.push_back(pick(0, 3) == 0 ? (pick(0, 1) ? 0 : c.T) : pick(0, c.T));
  std::sort(cuts.begin(), cuts.end());
  for (int r = 0; r < ranks; ++r)
    c.split.push_back(cuts[static_cast<std::size_t>(r) + 1] - cuts[static_cast<std::size_t>(r)]);

  if (pick(0, 4) == 0) {
    c.exempt.resize(static_cast<std::size_t>(c.T));
    for (auto& x : c.exempt) x = pick(0, 2) == 0 ? 1 : 0;
  }

  // Probabilities with deliberate ties: per token, continuous noise, small integers (ties inside the token),
  // or a copy of one of a few shared rows (exact ties across tokens).
  std::vector<std::vector<float>> shared(3);
  std::uniform_real_distribution<float> u(0.0F, 1.0F);
  for (auto& row : shared) {
    for (std::int64_t e = 0; e < c.E; ++e) row.push_back(static_cast<float>(pick(1, 4)));
  }
  const float skew = static_cast<float>(pick(0, 3));  // low expert ids more popular
  for (std::int64_t l = 0; l < num_layers; ++l) {
    std::vector<float> raw(static_cast<std::size_t>(c.T * c.E));
    for (std::int64_t t = 0; t < c.T; ++t) {
      const std::int64_t mode = pick(0, 2);
      const std::vector<float>& row = shared[static_cast<std::size_t>(pick(0, 2))];
      for (std::int64_t e = 0; e < c.E; ++e) {
        float x = mode == 0 ? u(rng)
                            : (mode == 1 ? static_cast<float>(pick(1, 3)) : row[static_cast<std::size_t>(e)]);
        if (mode == 0) x += skew * static_cast<float>(c.E - e) / static_cast<float>(c.E);
        raw[static_cast<std::size_t>(t * c.E + e)] = x;
      }
    }
    c.layers.push_back(make_layer(normalize_rows(raw, c.T, c.E), c.T, c.E, c.k, c.normalized, c.scaling));
  }
  return c;
}

TEST(CapacityStage, RandomRoutingsProperty) {
  constexpr int kCases = 10000;
  const auto start = std::chrono::steady_clock::now();
  int threaded = 0;
  int failures = 0;
  std::int64_t dropped = 0;
  std::int64_t rerouted = 0;
  for (int i = 0; i < kCases && failures < 3; ++i) {
    const Case c = random_case(0xC0FFEE00ULL + static_cast<std::uint64_t>(i));
    std::string fault;
    const bool global_multi = c.ranks() > 1 && c.config.scope == CapacityScope::global;
    threaded += global_multi ? 1 : 0;
    std::vector<Outcome> got;
    try {
      got = run_impl(c);
    } catch (const std::exception& e) {
      fault = std::string("threw: ") + e.what();
    }
    for (std::size_t l = 0; fault.empty() && l < c.layers.size(); ++l) {
      const auto layer = static_cast<std::int64_t>(l);
      fault = check_invariants(c, layer, got[l]);
      if (!fault.empty()) break;
      dropped += got[l].dropped;
      rerouted += got[l].rerouted;
      if (const std::optional<Outcome> want = reference(c, layer)) {
        fault = compare(*want, got[l], c.k, c.config.renormalize_after_drop);
        if (!fault.empty()) fault = "layer " + std::to_string(l) + " vs reference: " + fault;
      }
    }
    const bool rerouting =
        c.config.policy == CapacityPolicy::reroute || c.config.policy == CapacityPolicy::expanded;
    // Global scope: the single process (for placement-independent configurations) agrees bit for bit.
    if (fault.empty() && global_multi && c.config.granularity == CapacityGranularity::expert &&
        c.config.policy != CapacityPolicy::expanded) {
      Case one = c;
      one.placement = std::make_shared<const ExpertPlacement>(
          ExpertPlacement::contiguous(static_cast<std::int64_t>(c.layers.size()), c.E, 1));
      one.split = {c.T};
      const std::vector<Outcome> single = run_impl(one);
      for (std::size_t l = 0; fault.empty() && l < c.layers.size(); ++l) {
        fault = compare(single[l], got[l], c.k, false);
        if (!fault.empty()) fault = "layer " + std::to_string(l) + " vs np=1: " + fault;
      }
    }
    // Global scope, device bins: another split over the same placement agrees bit for bit.
    if (fault.empty() && global_multi && c.config.granularity == CapacityGranularity::device &&
        c.config.policy != CapacityPolicy::expanded && c.config.score == DropScore::random) {
      Case other = c;
      std::rotate(other.split.begin(), other.split.begin() + 1, other.split.end());
      const std::vector<Outcome> moved = run_impl(other);
      for (std::size_t l = 0; fault.empty() && l < c.layers.size(); ++l) {
        fault = compare(moved[l], got[l], c.k, false);
        if (!fault.empty()) fault = "layer " + std::to_string(l) + " vs another split: " + fault;
      }
    }
    // Rerouting never displaces what drop kept, and one more round only adds reroutes (cheap runs only).
    if (fault.empty() && rerouting && !global_multi) {
      Case drop = c;
      drop.config.policy = CapacityPolicy::drop;
      Case more = c;
      more.config.rounds = c.config.rounds + 1;
      const std::vector<Outcome> d = run_impl(drop);
      const std::vector<Outcome> m = run_impl(more);
      for (std::size_t l = 0; fault.empty() && l < c.layers.size(); ++l) {
        fault = check_extends(d[l], got[l], c.k);
        if (fault.empty()) fault = check_extends(got[l], m[l], c.k);
        if (!fault.empty()) fault = "layer " + std::to_string(l) + " rounds/drop monotonicity: " + fault;
      }
    }
    if (!fault.empty()) {
      ++failures;
      ADD_FAILURE() << "case " << i << " " << describe_case(c) << "\n" << fault;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%d cases (%d on thread groups), %lld slots dropped, %lld rerouted, %.2f s\n", kCases, threaded,
              static_cast<long long>(dropped), static_cast<long long>(rerouted), seconds);
  // The generator really exercises drops and reroutes.
  EXPECT_GT(dropped, 10000);
  EXPECT_GT(rerouted, 1000);
}

// DeepSeek-V3's routing shape at EP8 (issue: the new architectures work unchanged): 256 experts, each token's
// top-8 within 4 of 8 groups of 32 (the other groups' probabilities masked to zero, as group-limited routing
// does), normalized then scaled by 2.5, 8 ranks, a per-layer gamma; every policy, granularity and scope.
TEST(CapacityStage, DeepSeekV3ShapeAtEightRanksWithEveryOption) {
  constexpr std::int64_t kE = 256, kK = 8, kT = 200, kGroups = 8, kTopGroups = 4, kRanks = 8;
  std::mt19937_64 rng(0xD5EE3);
  std::uniform_real_distribution<float> u(0.0F, 1.0F);
  Case base;
  base.T = kT;
  base.k = kK;
  base.E = kE;
  base.normalized = true;
  base.scaling = 2.5F;
  base.placement = std::make_shared<const ExpertPlacement>(ExpertPlacement::contiguous(2, kE, kRanks));
  base.split = {40, 10, 30, 20, 25, 25, 0, 50};
  for (int l = 0; l < 2; ++l) {
    std::vector<float> raw(static_cast<std::size_t>(kT * kE), 0.0F);
    for (std::int64_t t = 0; t < kT; ++t) {
      std::vector<std::int64_t> groups(kGroups);
      for (std::int64_t g = 0; g < kGroups; ++g) groups[static_cast<std::size_t>(g)] = g;
      std::shuffle(groups.begin(), groups.end(), rng);
      for (std::int64_t i = 0; i < kTopGroups; ++i) {
        const std::int64_t g = groups[static_cast<std::size_t>(i)];
        for (std::int64_t e = g * (kE / kGroups); e < (g + 1) * (kE / kGroups); ++e)
          raw[static_cast<std::size_t>(t * kE + e)] = u(rng) + (e < 64 ? 0.5F : 0.0F);  // a hot range
      }
    }
    base.layers.push_back(make_layer(normalize_rows(raw, kT, kE), kT, kE, kK, true, 2.5F));
  }
  std::int64_t dropped = 0, rerouted = 0, checked = 0;
  for (const CapacityPolicy policy :
       {CapacityPolicy::drop, CapacityPolicy::reroute, CapacityPolicy::expanded}) {
    for (const CapacityGranularity granularity : {CapacityGranularity::expert, CapacityGranularity::device}) {
      for (const CapacityScope scope : {CapacityScope::local, CapacityScope::global}) {
        Case c = base;
        c.config.policy = policy;
        c.config.granularity = granularity;
        c.config.scope = scope;
        c.config.gamma = {1.0, 1.5};
        c.config.rounds = 2;
        c.config.local_experts = 2;
        SCOPED_TRACE(describe_case(c));
        const std::vector<Outcome> got = run_impl(c);
        for (std::int64_t l = 0; l < 2; ++l) {
          const Outcome& o = got[static_cast<std::size_t>(l)];
          EXPECT_EQ(check_invariants(c, l, o), "") << "layer " << l;
          if (const std::optional<Outcome> want = reference(c, l)) {
            EXPECT_EQ(compare(*want, o, kK, false), "") << "layer " << l;
            ++checked;
          }
          dropped += o.dropped;
          rerouted += o.rerouted;
        }
      }
    }
  }
  EXPECT_EQ(checked, 24);
  EXPECT_GT(dropped, 0);
  EXPECT_GT(rerouted, 0);
}

}  // namespace
}  // namespace capserve::parallel
