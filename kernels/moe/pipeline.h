#pragma once
// The launch sequences of the MoE index kernels, written once over an executor: the CUDA executor
// (kernels/cuda/moe_kernels.cu) launches each thread body as a kernel on a stream, the host executor
// (host_executor.cpp) runs its threads in a loop. Either way the same bodies run in the same order.
//
// An executor provides:
//   for_each(n, body)               body(i) for i in [0, n), one launch
//   zero(ptr, count)                count elements set to 0
//   exclusive_scan(data, n)         data[0..n) to its exclusive prefix sums, the total into data[n]
//   reduce_sum(data, n)             global scope: data[0..n) summed over the ranks (local scope: nothing)
//   kReadsStateFreely               true where the logic may read its state between launches at no cost (the
//                                   host); the CUDA executor's false keeps the sequence free of device syncs
#include <algorithm>
#include <cstdint>

#include "kernels/moe/dispatch_logic.h"
#include "kernels/moe/index_logic.h"

namespace capserve::kernels::moe {

template <class Exec>
void run_router(Exec& x, const RouteToken& body) {
  x.for_each(body.p.tokens, body);
}

inline bool any_bin_unresolved(const CapacityView& v) {
  for (std::int64_t b = 0; b < v.p.nbins; ++b) {
    if (v.select[b].unresolved != 0) return true;
  }
  return false;
}

// Per bin, the `select[b].need` largest candidate keys (of bins still unresolved) in up to eight radix
// rounds. A resolved bin skips the later rounds, so on a device all eight run and no round needs a decision
// from the host. Where the state is free to read, the rounds stop once every bin is resolved (each rank's
// state comes from the same global histograms, so all ranks stop at the same round): fewer collectives per
// layer.
template <class Exec>
void run_select(Exec& x, const CapacityView& v) {
  const std::int64_t slots = v.p.tokens * v.p.top_k;
  for (int shift = 64 - kRadixBits; shift >= 0; shift -= kRadixBits) {
    if constexpr (Exec::kReadsStateFreely) {
      if (!any_bin_unresolved(v)) return;
    }
    x.zero(v.hist, v.p.nbins * kRadixBuckets);
    x.for_each(slots, HistogramSlot{v, shift});
    x.reduce_sum(v.hist, v.p.nbins * kRadixBuckets);
    x.for_each(v.p.nbins, ResolveBin{v, shift});
  }
}

// One layer's capacity scheduling. Global scope sums the per-bin counts and radix histograms over the ranks
// (the executor's reduce_sum), so every rank reaches the same per-bin thresholds: the exact global top-C.
template <class Exec>
void run_capacity(Exec& x, const CapacityView& v) {
  const std::int64_t T = v.p.tokens;
  const std::int64_t slots = T * v.p.top_k;
  x.zero(v.counts, 2 * v.p.nbins);
  x.zero(v.totals, 2);
  x.for_each(T, PrepareToken{v});
  x.reduce_sum(v.counts, 2 * v.p.nbins);
  x.for_each(v.p.nbins, SetupBin{v});
  run_select(x, v);
  x.for_each(slots, ApplyDrop{v});
  if (v.p.reroute != RerouteKind::none) {
    if (v.p.reroute == RerouteKind::expanded) x.for_each(T, ChooseLocal{v});
    // A round without candidates changes nothing, and neither does any after it: stopping at the first such
    // round (where the state is free to read; the global counts agree on every rank) and running every round
    // reach the same state.
    for (std::int64_t round = 0; round < v.p.rounds; ++round) {
      x.zero(v.counts, v.p.nbins);
      x.for_each(T, RerouteCandidates{v});
      x.reduce_sum(v.counts, v.p.nbins);
      if constexpr (Exec::kReadsStateFreely) {
        if (std::all_of(v.counts, v.counts + v.p.nbins, [](std::int64_t c) { return c == 0; })) break;
      }
      x.for_each(v.p.nbins, BeginRerouteSelect{v});
      run_select(x, v);
      x.for_each(slots, ApplyReroute{v});
      x.for_each(v.p.nbins, ConsumeRoom{v});
    }
  }
  x.for_each(T, FinishToken{v});
}

// chunk_base needs num_groups * permute_chunks(p) + 1 elements.
template <class Exec>
void run_permute(Exec& x, const PermuteView& v) {
  const std::int64_t chunks = permute_chunks(v.p);
  const std::int64_t n = v.p.num_groups * chunks;
  x.zero(v.chunk_base, n + 1);
  x.for_each(chunks, PermuteCountChunk{v});
  x.exclusive_scan(v.chunk_base, n);
  x.for_each(v.p.num_groups + 1, PermuteOffsets{v, n});
  x.for_each(chunks, PermuteScatterChunk{v});
}

// The sender's dispatch plan: destinations, the send rows (a permute of each token's first slot per
// destination, grouped by rank) and the entries (a permute of every kept slot by rank), then each entry
// packed at its place.
struct DispatchPlanView {
  std::int64_t tokens = 0;
  std::int64_t top_k = 0;
  const std::int32_t* experts = nullptr;
  const float* weights = nullptr;
  const std::int32_t* owners = nullptr;
  const std::int32_t* local_index = nullptr;
  std::int32_t* dest = nullptr;        // [T, k] workspace
  std::int32_t* first_dest = nullptr;  // [T, k] workspace
  PermuteView rows;                    // experts = first_dest, groups = ranks
  PermuteView entry_slots;             // experts = dest, groups = ranks
  DispatchEntry* entries = nullptr;
  std::int64_t* counts = nullptr;  // [2, ranks]: rows, then entries, per destination
};

template <class Exec>
void run_plan_dispatch(Exec& x, const DispatchPlanView& v) {
  x.for_each(v.tokens, MapDestinations{v.top_k, v.experts, v.owners, v.dest, v.first_dest});
  run_permute(x, v.rows);
  run_permute(x, v.entry_slots);
  x.for_each(v.tokens * v.top_k,
             PackEntries{v.top_k, v.experts, v.weights, v.local_index, v.dest, v.rows.offsets,
                         v.rows.position, v.entry_slots.position, v.entries});
  x.for_each(v.rows.p.num_groups,
             CountsFromOffsets{v.rows.p.num_groups, v.rows.offsets, v.entry_slots.offsets, v.counts});
}

// The receiver's grouping: the entries into a [rows, k] matrix of local experts, then a permute by expert.
struct ReceivedView {
  std::int64_t entries = 0;  // received entries
  std::int64_t ranks = 0;
  UnpackEntries unpack;  // its experts / weights are group.experts and the weights matrix
  PermuteView group;     // tokens = received rows, groups = local experts
};

template <class Exec>
void run_group_received(Exec& x, const ReceivedView& v) {
  x.for_each(v.group.p.tokens * v.group.p.top_k, ClearSlots{v.unpack.experts, v.unpack.weights});
  x.for_each(v.entries, v.unpack);
  run_permute(x, v.group);
}

// The receiver's grouping of a block-layout exchange: as ReceivedView, the entries of each source in its
// block, valid up to its count.
struct ReceivedBlocksView {
  std::int64_t places = 0;  // ranks * entry_block
  UnpackBlockEntries unpack;
  PermuteView group;  // tokens = ranks * row_block
};

template <class Exec>
void run_group_received_blocks(Exec& x, const ReceivedBlocksView& v) {
  x.for_each(v.group.p.tokens * v.group.p.top_k, ClearSlots{v.unpack.experts, v.unpack.weights});
  x.for_each(v.places, v.unpack);
  run_permute(x, v.group);
}

}  // namespace capserve::kernels::moe
