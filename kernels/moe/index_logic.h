#pragma once
// The per-element index logic of the MoE kernels (router top-k, capacity scheduler, permute), written once as
// __host__ __device__ functions and "thread bodies": small functors whose operator()(i) is the work of thread
// i of one launch. The CUDA kernels (kernels/cuda/moe_kernels.cu) run them on the device; the host executor
// (host_executor.cpp, built by the plain C++ compiler) runs the very same bodies in a loop, and is what the
// CPU path routes and schedules capacity with: one implementation for every device.
//
// A body only writes what thread i owns, plus integer counters through add_count (an atomic on the device),
// whose sums do not depend on the order the threads run in; so running the threads one after another on the
// host makes the device's decisions from the same inputs. Not always from the same router probabilities: the
// device's expf may differ from the host's std::exp in the last bit (up to 2 ulp), so router probabilities,
// and a top-k choice between experts within rounding of each other, may differ (tests/gpu allows exactly
// that). The capacity scheduler and permute use only integers and comparisons of their inputs: those are
// bit-identical.
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"

namespace capserve::kernels::moe {

// ---------------------------------------------------------------------------------------------------------
// Scalars.

CAPSERVE_HD inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

// Single-precision exp: the device's expf, the host's std::exp (as the CPU router calls it).
CAPSERVE_HD inline float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

CAPSERVE_HD inline double ceil_f64(double x) {
#if defined(__CUDA_ARCH__)
  return ::ceil(x);
#else
  return std::ceil(x);
#endif
}

// Integer counters: atomic on the device and on the host. The host executor runs the threads in turn, so a
// plain add would do there, but the CUDA emulation's race detector (tests/cuda_emu) runs these bodies under
// TSan as unordered threads, where only an atomic is no race; and this inline function must be the same in
// the host executor and the emulated kernels, which one program may link together.
CAPSERVE_HD inline void add_count(std::int64_t* p, std::int64_t v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
#else
  std::atomic_ref<std::int64_t>(*p).fetch_add(v, std::memory_order_relaxed);
#endif
}

CAPSERVE_HD inline std::int64_t min_i64(std::int64_t a, std::int64_t b) {
  return a < b ? a : b;
}
CAPSERVE_HD inline std::int64_t max_i64(std::int64_t a, std::int64_t b) {
  return a > b ? a : b;
}

CAPSERVE_HD inline bool contains(const std::int32_t* row, std::int64_t n, std::int32_t e) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (row[i] == e) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------------------
// Router: logits [T, E] -> probabilities [T, E], top-k ids and weights [T, k]. One thread per token.

enum class RouterScore : std::uint8_t { softmax, sigmoid };
// How group-limited routing ranks a group: by its best expert (DeepSeek-V2) or by the sum of its best two
// (DeepSeek-V3).
enum class GroupScore : std::uint8_t { best, top2_sum };

struct RouterParams {
  std::int64_t tokens = 0;
  std::int64_t num_experts = 0;
  std::int64_t top_k = 0;
  RouterScore score = RouterScore::softmax;
  std::int64_t n_group = 1;     // group-limited routing (DeepSeek): experts in n_group equal groups, ...
  std::int64_t topk_group = 1;  // ... of which the topk_group best (group_score) are eligible (<= 64)
  GroupScore group_score = GroupScore::best;
  bool normalize = false;  // norm_topk_prob
  float scaling = 1.0F;    // routed_scaling_factor
};

// Top-k rule: experts are scanned in ascending id and a later one replaces the best only when strictly more
// probable, so ties go to the lower id.
CAPSERVE_HD inline bool topk_better(float candidate, float best) {
  return candidate > best;
}

// The largest of n values, as std::max_element finds it (the first one no later value exceeds).
CAPSERVE_HD inline float row_max(const float* x, std::int64_t n) {
  float m = x[0];
  for (std::int64_t i = 1; i < n; ++i) {
    if (m < x[i]) m = x[i];
  }
  return m;
}

// With a correction bias (DeepSeek-V3's e_score_correction_bias, [E]), groups and experts are chosen by
// score + bias, but the weights are the scores themselves.
struct RouteToken {
  RouterParams p;
  const float* logits;
  const float* bias;  // [E] or null
  float* probs;
  std::int32_t* experts;
  float* weights;

  CAPSERVE_HD float choice(const float* prob, std::int64_t e) const {
    return bias != nullptr ? prob[e] + bias[e] : prob[e];
  }

  // The group's rank among groups: its best choice value, or the sum of its best two.
  CAPSERVE_HD float group_value(const float* prob, std::int64_t first, std::int64_t size) const {
    float best = choice(prob, first);
    if (p.group_score == GroupScore::best) {
      for (std::int64_t e = first + 1; e < first + size; ++e)
        best = best < choice(prob, e) ? choice(prob, e) : best;
      return best;
    }
    float second = -INFINITY;
    for (std::int64_t e = first + 1; e < first + size; ++e) {
      const float v = choice(prob, e);
      if (v > best) {
        second = best;
        best = v;
      } else if (v > second) {
        second = v;
      }
    }
    return best + second;
  }

  CAPSERVE_HD void operator()(std::int64_t t) const {
    const std::int64_t E = p.num_experts;
    const std::int64_t k = p.top_k;
    const float* logit = logits + t * E;
    float* prob = probs + t * E;
    if (p.score == RouterScore::softmax) {
      const float mx = row_max(logit, E);
      float sum = 0.0F;
      for (std::int64_t e = 0; e < E; ++e) {
        prob[e] = exp_f32(logit[e] - mx);
        sum += prob[e];
      }
      for (std::int64_t e = 0; e < E; ++e) prob[e] /= sum;
    } else {
      for (std::int64_t e = 0; e < E; ++e) prob[e] = 1.0F / (1.0F + exp_f32(-logit[e]));
    }
    const std::int64_t group_size = E / p.n_group;
    const bool limited = p.topk_group < p.n_group;
    std::uint64_t groups = 0;  // bit g: group g is eligible
    if (limited) {
      for (std::int64_t chosen = 0; chosen < p.topk_group; ++chosen) {
        std::int64_t best = -1;
        float best_value = 0.0F;
        for (std::int64_t g = 0; g < p.n_group; ++g) {
          if ((groups >> g) & 1U) continue;
          const float v = group_value(prob, g * group_size, group_size);
          if (best < 0 || topk_better(v, best_value)) {
            best = g;
            best_value = v;
          }
        }
        groups |= std::uint64_t{1} << best;
      }
    }
    std::int32_t* ids = experts + t * k;
    float* w = weights + t * k;
    for (std::int64_t s = 0; s < k; ++s) {
      std::int64_t best = -1;
      for (std::int64_t e = 0; e < E; ++e) {
        if (limited && ((groups >> (e / group_size)) & 1U) == 0) continue;
        if (contains(ids, s, static_cast<std::int32_t>(e))) continue;
        if (best < 0 || topk_better(choice(prob, e), choice(prob, best))) best = e;
      }
      ids[s] = static_cast<std::int32_t>(best);
      w[s] = prob[best];
    }
    if (p.normalize) {
      float total = 0.0F;
      for (std::int64_t s = 0; s < k; ++s) total += w[s];
      for (std::int64_t s = 0; s < k; ++s) w[s] /= total;
    }
    if (p.scaling != 1.0F) {
      for (std::int64_t s = 0; s < k; ++s) w[s] *= p.scaling;
    }
  }
};

// ---------------------------------------------------------------------------------------------------------
// Capacity scheduler, local scope (parallel/README.md; the same decisions as parallel::CapacityStage).

enum class ScoreKind : std::uint8_t { gate, order, reverse_order, random };
enum class RerouteKind : std::uint8_t { none, reroute, expanded };
// The values of parallel::SlotStatus.
enum class SlotState : std::uint8_t { kept = 0, dropped = 1, rerouted = 2 };

constexpr std::uint64_t kLow32 = 0xFFFFFFFFULL;
constexpr int kRadixBits = 8;
constexpr int kRadixBuckets = 1 << kRadixBits;

CAPSERVE_HD inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Non-negative floats order like their bit patterns.
CAPSERVE_HD inline std::uint32_t weight_score(float w) {
  return w > 0.0F ? float_bits(w) : 0U;
}

// Selection key, larger wins: (score << 32) | ~(global token * top_k + slot). The low half makes keys unique,
// so ties go to the earlier token, then the earlier slot.
CAPSERVE_HD inline std::uint64_t selection_key(ScoreKind kind, std::uint64_t seed, std::int64_t layer,
                                               std::uint64_t global_token, std::int64_t slot,
                                               std::int32_t expert, float weight, std::int64_t top_k,
                                               std::int64_t num_experts) {
  std::uint64_t score = 0;
  switch (kind) {
    case ScoreKind::gate:
      score = weight_score(weight);
      break;
    case ScoreKind::order:
      score = kLow32 - global_token;
      break;
    case ScoreKind::reverse_order:
      score = global_token;
      break;
    case ScoreKind::random:
      score = mix64(seed ^ mix64((static_cast<std::uint64_t>(layer) << 40) ^
                                 (global_token * static_cast<std::uint64_t>(num_experts) +
                                  static_cast<std::uint64_t>(expert)))) >>
              32;
      break;
  }
  const std::uint64_t index =
      global_token * static_cast<std::uint64_t>(top_k) + static_cast<std::uint64_t>(slot);
  return (score << 32) | (kLow32 - index);
}

// ceil(gamma * N_bar * experts_in_bin) with N_bar = T * k / E, as gamma * (T * k * n) / E: the integer
// product is exact, leaving one rounding in the product with gamma and one in the division.
CAPSERVE_HD inline std::int64_t bin_capacity(double gamma, std::int64_t total_tokens, std::int64_t top_k,
                                             std::int64_t experts_in_bin, std::int64_t num_experts) {
  const std::int64_t assignments = total_tokens * top_k * experts_in_bin;
  return static_cast<std::int64_t>(
      ceil_f64(gamma * static_cast<double>(assignments) / static_cast<double>(num_experts)));
}

// The bin an expert's assignment counts against: the expert itself, or (device granularity) its rank.
CAPSERVE_HD inline std::int32_t bin_of(std::int32_t expert, const std::int32_t* owners) {
  return owners == nullptr ? expert : owners[expert];
}

// Gate weight of a slot moved to an expert with probability p, normalized like the model's own top-k.
CAPSERVE_HD inline float reroute_weight(float p, float denominator, bool normalized, float scaling) {
  return (normalized ? p / denominator : p) * scaling;
}

// Radix select, one byte per round from the top: the key bits above `shift + 8` must equal the bin's prefix.
CAPSERVE_HD inline std::uint64_t radix_high_mask(int shift) {
  return shift + kRadixBits >= 64 ? 0 : ~std::uint64_t{0} << (shift + kRadixBits);
}
CAPSERVE_HD inline std::uint32_t radix_digit(std::uint64_t key, int shift) {
  return static_cast<std::uint32_t>((key >> shift) & (kRadixBuckets - 1));
}

// One bin's state during a selection of its `need` largest candidate keys.
struct SelectState {
  std::uint64_t prefix;     // the threshold bits fixed so far
  std::int64_t need;        // keys still to keep among those matching the prefix
  std::uint64_t threshold;  // keep keys >= threshold (once resolved)
  std::uint8_t take_none;   // capacity 0: keep nothing
  std::uint8_t unresolved;  // still searching
};

// Start: every candidate fits (threshold 0), none may (take_none), or a search for the `capacity` largest.
CAPSERVE_HD inline SelectState begin_select(std::int64_t candidates, std::int64_t capacity) {
  SelectState s{0, 0, 0, 0, 0};
  if (candidates <= capacity) return s;
  if (capacity <= 0) {
    s.take_none = 1;
    return s;
  }
  s.need = capacity;
  s.unresolved = 1;
  return s;
}

// One round: given the histogram of the digit at `shift` over the candidates matching the prefix, fix that
// digit of the threshold: the largest digit d with (keys in buckets above d) < need <= (keys in buckets >=
// d). When bucket d completes the count exactly the bin is resolved; else the search continues inside d.
CAPSERVE_HD inline void radix_resolve(SelectState& s, const std::int64_t* hist, int shift) {
  if (s.unresolved == 0) return;
  std::int64_t above = 0;
  for (int d = kRadixBuckets - 1; d >= 0; --d) {
    const std::int64_t c = hist[d];
    if (above + c < s.need) {
      above += c;
      continue;
    }
    s.prefix |= static_cast<std::uint64_t>(d) << shift;
    if (above + c == s.need) {
      s.threshold = s.prefix;
      s.unresolved = 0;
    } else {
      s.need -= above;
    }
    return;
  }
}

CAPSERVE_HD inline bool keep_key(const SelectState& s, std::uint64_t key) {
  return s.take_none == 0 && key >= s.threshold;
}

// Rerouting: a token's candidate expert must have room in its bin and must not be one the token already
// chose (originally, by an earlier reroute, or for an earlier slot in this round); the most probable wins,
// ties to the lower id (experts are offered in ascending order).
CAPSERVE_HD inline bool reroute_taken(std::int32_t e, const std::int32_t* original,
                                      const std::int32_t* current, std::int64_t top_k,
                                      const std::int32_t* round_choices, std::int64_t earlier_slots) {
  return contains(original, top_k, e) || contains(current, top_k, e) ||
         contains(round_choices, earlier_slots, e);
}

struct CapacityParams {
  std::int64_t tokens = 0;
  std::int64_t top_k = 0;
  std::int64_t num_experts = 0;
  std::int64_t nbins = 0;         // num_experts (expert granularity) or ranks (device granularity)
  std::int64_t total_tokens = 0;  // tokens of the step over the scope: `tokens` in local scope
  std::int64_t token_offset = 0;  // global index of the first token: 0 in local scope
  double gamma = 1.0;
  RerouteKind reroute = RerouteKind::none;
  std::int64_t rounds = 1;
  std::int64_t local_experts = 1;  // expanded: m fallbacks on this rank
  ScoreKind score = ScoreKind::gate;
  std::uint64_t seed = 0;
  std::int64_t layer = 0;
  bool normalized = false;  // weights are probs / sum of the top-k probs
  float scaling = 1.0F;
  bool renormalize_after_drop = false;
};

// Everything one layer's scheduling reads and writes; the workspace arrays come from bind_capacity_workspace.
struct CapacityView {
  CapacityParams p;
  const float* probs = nullptr;               // [T, E]
  const std::uint8_t* exempt = nullptr;       // [T] or null
  const std::int32_t* owners = nullptr;       // [E] (device granularity) or null (expert granularity)
  const std::int32_t* bin_experts = nullptr;  // [nbins]: experts per bin (device granularity) or null
  const std::int32_t* local_list = nullptr;   // [num_local]: this rank's experts, ascending (expanded)
  std::int64_t num_local = 0;
  std::int32_t* experts = nullptr;  // [T, k] in/out: -1 where dropped
  float* weights = nullptr;         // [T, k] in/out
  std::uint8_t* status = nullptr;   // [T, k] out: SlotState
  // Workspace.
  std::int32_t* original = nullptr;       // [T, k]
  std::int32_t* cand_bin = nullptr;       // [T, k]: -1 when the slot is not a candidate
  std::int32_t* cand_expert = nullptr;    // [T, k]: reroutes
  std::uint64_t* cand_key = nullptr;      // [T, k]
  float* denominator = nullptr;           // [T]
  float* weight_sum = nullptr;            // [T]
  std::int32_t* local_choice = nullptr;   // [T, m]
  std::int64_t* counts = nullptr;         // [2 * nbins]: candidates, exempt
  std::int64_t* capacity = nullptr;       // [nbins]
  std::int64_t* cand_capacity = nullptr;  // [nbins]
  std::int64_t* room = nullptr;           // [nbins]
  SelectState* select = nullptr;          // [nbins]
  std::int64_t* hist = nullptr;           // [nbins, 256]
  std::int64_t* totals = nullptr;         // [2]: dropped, rerouted
};

// Workspace: one block of bytes, carved into the arrays above (16-byte aligned each).
struct CapacityWorkspace {
  std::int64_t bytes = 0;
  std::int64_t original, cand_bin, cand_expert, cand_key, denominator, weight_sum, local_choice, counts,
      capacity, cand_capacity, room, select, hist, totals;
};

CAPSERVE_HD inline std::int64_t align16(std::int64_t n) {
  return (n + 15) / 16 * 16;
}

inline CapacityWorkspace capacity_workspace(const CapacityParams& p) {
  CapacityWorkspace w{};
  const std::int64_t slots = p.tokens * p.top_k;
  const std::int64_t m = p.reroute == RerouteKind::expanded ? p.local_experts : 0;
  std::int64_t at = 0;
  const auto take = [&at](std::int64_t bytes) {
    const std::int64_t here = at;
    at += align16(bytes);
    return here;
  };
  w.original = take(slots * 4);
  w.cand_bin = take(slots * 4);
  w.cand_expert = take(slots * 4);
  w.cand_key = take(slots * 8);
  w.denominator = take(p.tokens * 4);
  w.weight_sum = take(p.tokens * 4);
  w.local_choice = take(p.tokens * m * 4);
  w.counts = take(2 * p.nbins * 8);
  w.capacity = take(p.nbins * 8);
  w.cand_capacity = take(p.nbins * 8);
  w.room = take(p.nbins * 8);
  w.select = take(p.nbins * static_cast<std::int64_t>(sizeof(SelectState)));
  w.hist = take(p.nbins * kRadixBuckets * 8);
  w.totals = take(2 * 8);
  w.bytes = at;
  return w;
}

// Points the view's workspace arrays into `base` (16-byte aligned, capacity_workspace(v.p).bytes long).
inline void bind_capacity_workspace(CapacityView& v, void* base) {
  const CapacityWorkspace w = capacity_workspace(v.p);
  auto* b = static_cast<unsigned char*>(base);
  v.original = reinterpret_cast<std::int32_t*>(b + w.original);
  v.cand_bin = reinterpret_cast<std::int32_t*>(b + w.cand_bin);
  v.cand_expert = reinterpret_cast<std::int32_t*>(b + w.cand_expert);
  v.cand_key = reinterpret_cast<std::uint64_t*>(b + w.cand_key);
  v.denominator = reinterpret_cast<float*>(b + w.denominator);
  v.weight_sum = reinterpret_cast<float*>(b + w.weight_sum);
  v.local_choice = reinterpret_cast<std::int32_t*>(b + w.local_choice);
  v.counts = reinterpret_cast<std::int64_t*>(b + w.counts);
  v.capacity = reinterpret_cast<std::int64_t*>(b + w.capacity);
  v.cand_capacity = reinterpret_cast<std::int64_t*>(b + w.cand_capacity);
  v.room = reinterpret_cast<std::int64_t*>(b + w.room);
  v.select = reinterpret_cast<SelectState*>(b + w.select);
  v.hist = reinterpret_cast<std::int64_t*>(b + w.hist);
  v.totals = reinterpret_cast<std::int64_t*>(b + w.totals);
}

// Thread per token: every slot starts kept; the token's original experts, the sums its weights are
// normalized by, and its drop candidates (key and bin), counted per bin. Exempt tokens only use up capacity.
struct PrepareToken {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t t) const {
    const std::int64_t k = v.p.top_k;
    const std::int64_t E = v.p.num_experts;
    const bool exempt = v.exempt != nullptr && v.exempt[t] != 0;
    float p = 0.0F;
    float w = 0.0F;
    for (std::int64_t s = 0; s < k; ++s) {
      const std::int64_t slot = t * k + s;
      const std::int32_t e = v.experts[slot];
      p += v.probs[t * E + e];
      w += v.weights[slot];
      v.status[slot] = static_cast<std::uint8_t>(SlotState::kept);
      v.original[slot] = e;
      v.cand_expert[slot] = -1;
      const std::int32_t b = bin_of(e, v.owners);
      if (exempt) {
        v.cand_bin[slot] = -1;
        add_count(v.counts + v.p.nbins + b, 1);
        continue;
      }
      add_count(v.counts + b, 1);
      v.cand_bin[slot] = b;
      v.cand_key[slot] =
          selection_key(v.p.score, v.p.seed, v.p.layer, static_cast<std::uint64_t>(v.p.token_offset + t), s,
                        e, v.weights[slot], k, E);
    }
    v.denominator[t] = p;
    v.weight_sum[t] = w;
  }
};

// Thread per bin: its capacity, what is left of it for candidates after exempt slots, the room left for
// reroutes, and the start of the drop selection.
struct SetupBin {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t b) const {
    const std::int64_t in_bin = v.bin_experts == nullptr ? 1 : v.bin_experts[b];
    v.capacity[b] = bin_capacity(v.p.gamma, v.p.total_tokens, v.p.top_k, in_bin, v.p.num_experts);
    const std::int64_t exempt = v.counts[v.p.nbins + b];
    v.cand_capacity[b] = max_i64(0, v.capacity[b] - exempt);
    const std::int64_t kept = exempt + min_i64(v.counts[b], v.cand_capacity[b]);
    v.room[b] = max_i64(0, v.capacity[b] - kept);
    v.select[b] = begin_select(v.counts[b], v.cand_capacity[b]);
  }
};

// Thread per bin: the start of a reroute round's selection, bounded by the room left.
struct BeginRerouteSelect {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t b) const { v.select[b] = begin_select(v.counts[b], v.room[b]); }
};

// Thread per slot: one radix round's histogram of the candidates of unresolved bins matching the prefix.
struct HistogramSlot {
  CapacityView v;
  int shift;
  CAPSERVE_HD void operator()(std::int64_t slot) const {
    const std::int32_t b = v.cand_bin[slot];
    if (b < 0) return;
    const SelectState& s = v.select[b];
    if (s.unresolved == 0) return;
    const std::uint64_t key = v.cand_key[slot];
    if ((key & radix_high_mask(shift)) != s.prefix) return;
    add_count(v.hist + b * kRadixBuckets + radix_digit(key, shift), 1);
  }
};

// Thread per bin: fixes one digit of the bin's threshold.
struct ResolveBin {
  CapacityView v;
  int shift;
  CAPSERVE_HD void operator()(std::int64_t b) const {
    radix_resolve(v.select[b], v.hist + b * kRadixBuckets, shift);
  }
};

// Thread per slot: a candidate below its bin's threshold is dropped.
struct ApplyDrop {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t slot) const {
    const std::int32_t b = v.cand_bin[slot];
    if (b < 0 || keep_key(v.select[b], v.cand_key[slot])) return;
    v.experts[slot] = -1;
    v.weights[slot] = 0.0F;
    v.status[slot] = static_cast<std::uint8_t>(SlotState::dropped);
  }
};

// Thread per token (expanded drop): its m most probable experts on this rank outside its top-k, ties to the
// lower id; -1 where the rank has too few.
struct ChooseLocal {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t t) const {
    const std::int64_t m = v.p.local_experts;
    const std::int64_t k = v.p.top_k;
    const float* prob = v.probs + t * v.p.num_experts;
    std::int32_t* choice = v.local_choice + t * m;
    const std::int32_t* orig = v.original + t * k;
    for (std::int64_t j = 0; j < m; ++j) {
      std::int32_t best = -1;
      for (std::int64_t i = 0; i < v.num_local; ++i) {
        const std::int32_t e = v.local_list[i];
        if (contains(orig, k, e) || contains(choice, j, e)) continue;
        if (best < 0 || topk_better(prob[e], prob[best])) best = e;
      }
      choice[j] = best;
    }
  }
};

// Thread per token: one reroute round's candidate for each of its dropped slots.
struct RerouteCandidates {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t t) const {
    const std::int64_t k = v.p.top_k;
    const std::int64_t E = v.p.num_experts;
    const std::int64_t m = v.p.local_experts;
    const float* prob = v.probs + t * E;
    std::int32_t* round_choices = v.cand_expert + t * k;
    for (std::int64_t s = 0; s < k; ++s) {
      v.cand_bin[t * k + s] = -1;
      round_choices[s] = -1;
    }
    for (std::int64_t s = 0; s < k; ++s) {
      const std::int64_t slot = t * k + s;
      if (v.status[slot] != static_cast<std::uint8_t>(SlotState::dropped)) continue;
      std::int32_t best = -1;
      const auto consider = [&](std::int32_t e) {
        if (e < 0 || v.room[bin_of(e, v.owners)] <= 0 ||
            reroute_taken(e, v.original + t * k, v.experts + t * k, k, round_choices, s))
          return;
        if (best < 0 || topk_better(prob[e], prob[best])) best = e;
      };
      if (v.p.reroute == RerouteKind::expanded) {
        for (std::int64_t j = 0; j < m; ++j) consider(v.local_choice[t * m + j]);
      } else {
        for (std::int32_t e = 0; e < E; ++e) consider(e);
      }
      if (best < 0) continue;
      const float w = reroute_weight(prob[best], v.denominator[t], v.p.normalized, v.p.scaling);
      const std::int32_t b = bin_of(best, v.owners);
      add_count(v.counts + b, 1);
      v.cand_bin[slot] = b;
      v.cand_key[slot] = selection_key(v.p.score, v.p.seed, v.p.layer,
                                       static_cast<std::uint64_t>(v.p.token_offset + t), s, best, w, k, E);
      round_choices[s] = best;
    }
  }
};

// Thread per slot: a selected reroute candidate moves to its new expert.
struct ApplyReroute {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t slot) const {
    const std::int32_t b = v.cand_bin[slot];
    if (b < 0 || !keep_key(v.select[b], v.cand_key[slot])) return;
    const std::int64_t t = slot / v.p.top_k;
    const std::int32_t e = v.cand_expert[slot];
    v.experts[slot] = e;
    v.weights[slot] =
        reroute_weight(v.probs[t * v.p.num_experts + e], v.denominator[t], v.p.normalized, v.p.scaling);
    v.status[slot] = static_cast<std::uint8_t>(SlotState::rerouted);
  }
};

// Thread per bin: the round's kept reroutes use up room.
struct ConsumeRoom {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t b) const { v.room[b] -= min_i64(v.counts[b], v.room[b]); }
};

// Thread per token: dropped/rerouted totals and, when asked, the weights of a token that lost a slot scaled
// back to its original sum.
struct FinishToken {
  CapacityView v;
  CAPSERVE_HD void operator()(std::int64_t t) const {
    const std::int64_t k = v.p.top_k;
    float kept_sum = 0.0F;
    std::int64_t dropped = 0;
    std::int64_t rerouted = 0;
    for (std::int64_t s = 0; s < k; ++s) {
      const auto st = static_cast<SlotState>(v.status[t * k + s]);
      dropped += st == SlotState::dropped ? 1 : 0;
      rerouted += st == SlotState::rerouted ? 1 : 0;
      kept_sum += v.weights[t * k + s];
    }
    if (dropped > 0) add_count(v.totals, dropped);
    if (rerouted > 0) add_count(v.totals + 1, rerouted);
    if (v.p.renormalize_after_drop && dropped > 0 && kept_sum > 0.0F) {
      const float f = v.weight_sum[t] / kept_sum;
      for (std::int64_t s = 0; s < k; ++s) v.weights[t * k + s] *= f;
    }
  }
};

// ---------------------------------------------------------------------------------------------------------
// Permute: the kept (token, slot) pairs whose expert this rank hosts, grouped by local expert, stable in
// (token, slot) order — the order TokenDispatcher hands its grouped rows to the expert FFN. A counting sort
// in chunks: per chunk and group a count (thread per chunk), an exclusive scan over (group, chunk), then each
// chunk's thread walks its slots in order again and places them.

struct PermuteParams {
  std::int64_t tokens = 0;
  std::int64_t top_k = 0;
  std::int64_t num_groups = 0;  // local experts
  std::int64_t chunk = 256;     // slots per chunk
  std::int32_t rank = 0;
};

CAPSERVE_HD inline std::int64_t permute_chunks(const PermuteParams& p) {
  const std::int64_t slots = p.tokens * p.top_k;
  const std::int64_t n = (slots + p.chunk - 1) / p.chunk;
  return n > 0 ? n : 1;
}

struct PermuteView {
  PermuteParams p;
  const std::int32_t* experts = nullptr;      // [T, k]: -1 where dropped
  const std::int32_t* owners = nullptr;       // [E] or null (every expert is local, group = expert id)
  const std::int32_t* local_index = nullptr;  // [E]: position among the owner's experts
  std::int64_t* chunk_base = nullptr;         // [groups, chunks]: counts, then start offsets (workspace)
  std::int64_t* offsets = nullptr;            // [groups + 1]: rows of group g are [offsets[g], offsets[g+1])
  std::int64_t* position = nullptr;           // [T, k]: the slot's row, -1 when not here
  std::int32_t* row_token = nullptr;          // [T * k]: token of each row (the first offsets[groups])
};

// The local group (expert) of an assignment, -1 when it is dropped or lives on another rank.
CAPSERVE_HD inline std::int32_t permute_group(std::int32_t expert, const std::int32_t* owners,
                                              const std::int32_t* local_index, std::int32_t rank) {
  if (expert < 0) return -1;
  if (owners == nullptr) return expert;
  return owners[expert] == rank ? local_index[expert] : -1;
}

struct PermuteCountChunk {
  PermuteView v;
  CAPSERVE_HD void operator()(std::int64_t c) const {
    const std::int64_t chunks = permute_chunks(v.p);
    const std::int64_t slots = v.p.tokens * v.p.top_k;
    const std::int64_t end = min_i64(slots, (c + 1) * v.p.chunk);
    for (std::int64_t slot = c * v.p.chunk; slot < end; ++slot) {
      const std::int32_t g = permute_group(v.experts[slot], v.owners, v.local_index, v.p.rank);
      if (g >= 0) ++v.chunk_base[g * chunks + c];
    }
  }
};

// Thread per group (plus one): the group's first row, read before the scatter advances the bases.
struct PermuteOffsets {
  PermuteView v;
  std::int64_t total_index;  // where the scan left the total, in chunk_base's trailing element
  CAPSERVE_HD void operator()(std::int64_t g) const {
    v.offsets[g] = g < v.p.num_groups ? v.chunk_base[g * permute_chunks(v.p)] : v.chunk_base[total_index];
  }
};

struct PermuteScatterChunk {
  PermuteView v;
  CAPSERVE_HD void operator()(std::int64_t c) const {
    const std::int64_t chunks = permute_chunks(v.p);
    const std::int64_t slots = v.p.tokens * v.p.top_k;
    const std::int64_t end = min_i64(slots, (c + 1) * v.p.chunk);
    for (std::int64_t slot = c * v.p.chunk; slot < end; ++slot) {
      const std::int32_t g = permute_group(v.experts[slot], v.owners, v.local_index, v.p.rank);
      if (g < 0) {
        v.position[slot] = -1;
        continue;
      }
      const std::int64_t row = v.chunk_base[g * chunks + c]++;
      v.position[slot] = row;
      v.row_token[row] = static_cast<std::int32_t>(slot / v.p.top_k);
    }
  }
};

}  // namespace capserve::kernels::moe
