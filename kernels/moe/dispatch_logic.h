#pragma once
// The index logic of expert-parallel dispatch, as thread bodies like index_logic.h's: the sender's plan (each
// token's hidden row once per destination rank hosting any of its kept experts, plus one entry per kept
// slot saying which row, which of the destination's experts and with what gate weight), and the receiver's
// unpacking of those entries into a [rows, top_k] matrix that permute then groups by local expert. Rows and
// entries are grouped by destination in (token, slot) order, so what a rank receives is ordered by source
// rank, then the source's token order: the same on every device and every run.
#include <cstdint>

#include "kernels/moe/index_logic.h"

namespace capserve::kernels::moe {

// One dispatched (row, expert) pair on the wire.
struct DispatchEntry {
  std::int32_t row;           // row within the block sent to this destination
  std::int32_t local_expert;  // index among the destination's experts
  float weight;
};
static_assert(sizeof(DispatchEntry) == 12, "the wire format of one dispatched assignment");

// Thread per token: each slot's destination rank (-1 when dropped), and the same again only where the slot is
// the token's first one going to that rank (where its row is sent from).
struct MapDestinations {
  std::int64_t top_k;
  const std::int32_t* experts;  // [T, k]
  const std::int32_t* owners;   // [E]
  std::int32_t* dest;           // [T, k]
  std::int32_t* first_dest;     // [T, k]
  CAPSERVE_HD void operator()(std::int64_t t) const {
    std::int32_t* d = dest + t * top_k;
    for (std::int64_t s = 0; s < top_k; ++s) {
      const std::int32_t e = experts[t * top_k + s];
      d[s] = e < 0 ? -1 : owners[e];
      first_dest[t * top_k + s] = d[s] >= 0 && !contains(d, s, d[s]) ? d[s] : -1;
    }
  }
};

// Thread per slot: the kept slot's entry, at its place among its destination's entries. Its row is the
// position of its token's row in that destination's block.
struct PackEntries {
  std::int64_t top_k;
  const std::int32_t* experts;         // [T, k]
  const float* weights;                // [T, k]
  const std::int32_t* local_index;     // [E]
  const std::int32_t* dest;            // [T, k]
  const std::int64_t* row_offsets;     // [ranks + 1]: first row of each destination's block
  const std::int64_t* row_position;    // [T, k]: row of each token's first slot per destination
  const std::int64_t* entry_position;  // [T, k]: place of each kept slot's entry
  DispatchEntry* entries;
  CAPSERVE_HD void operator()(std::int64_t slot) const {
    const std::int32_t d = dest[slot];
    if (d < 0) return;
    std::int64_t first = slot - slot % top_k;
    while (dest[first] != d) ++first;
    entries[entry_position[slot]] = {static_cast<std::int32_t>(row_position[first] - row_offsets[d]),
                                     local_index[experts[slot]], weights[slot]};
  }
};

// Thread per destination rank: its rows and entries, from the two permutes' offsets.
struct CountsFromOffsets {
  std::int64_t ranks;
  const std::int64_t* row_offsets;    // [ranks + 1]
  const std::int64_t* entry_offsets;  // [ranks + 1]
  std::int64_t* counts;               // [2, ranks]
  CAPSERVE_HD void operator()(std::int64_t d) const {
    counts[d] = row_offsets[d + 1] - row_offsets[d];
    counts[ranks + d] = entry_offsets[d + 1] - entry_offsets[d];
  }
};

// Thread per received row slot: empty (-1, weight 0) before the entries are unpacked.
struct ClearSlots {
  std::int32_t* experts;
  float* weights;
  CAPSERVE_HD void operator()(std::int64_t i) const {
    experts[i] = -1;
    weights[i] = 0.0F;
  }
};

// Thread per received entry: into the [rows, top_k] matrix of local experts and weights, at its row (among
// all received rows: the source's block start plus the entry's row) and its rank among that row's entries
// (a row's entries arrive together, in the source's slot order).
struct UnpackEntries {
  std::int64_t top_k;
  std::int64_t ranks;
  const DispatchEntry* entries;     // [n]: the sources' blocks in rank order
  const std::int64_t* entry_start;  // [ranks + 1]: first entry of each source
  const std::int64_t* row_start;    // [ranks + 1]: first row of each source
  std::int32_t* experts;            // [rows, k]
  float* weights;                   // [rows, k]
  CAPSERVE_HD void operator()(std::int64_t i) const {
    std::int64_t source = 0;
    while (source + 1 < ranks && entry_start[source + 1] <= i) ++source;
    const DispatchEntry en = entries[i];
    std::int64_t slot = 0;
    for (std::int64_t j = i; j > entry_start[source] && entries[j - 1].row == en.row; --j) ++slot;
    const std::int64_t at = (row_start[source] + en.row) * top_k + slot;
    experts[at] = en.local_expert;
    weights[at] = en.weight;
  }
};

// The fixed-size block layout of a capacity-bounded exchange (runtime/README.md, "Decode without host
// waits"): group g (a destination rank, a source rank, a local expert) owns places [g * block, (g + 1) *
// block), its rows first, the rest empty, so no size depends on the routing and the host never reads one.

// Thread per place of the block layout: index[g * block + j] = source[offsets[g] + j] (offsets[g] + j
// without a source) for j below the group's count, -1 past it. A group larger than its block (the capacity
// bound broken) adds its excess to *overflow, which the step's report carries to the host.
struct BlockIndex {
  std::int64_t block;
  const std::int64_t* offsets;  // [groups + 1]
  const std::int32_t* source;   // [offsets[groups]] or null
  std::int32_t* index;          // [groups * block]
  std::int64_t* overflow;       // [1]
  CAPSERVE_HD void operator()(std::int64_t i) const {
    const std::int64_t g = i / block;
    const std::int64_t j = i % block;
    const std::int64_t count = offsets[g + 1] - offsets[g];
    if (j == 0 && count > block) add_count(overflow, count - block);
    const std::int64_t from = offsets[g] + j;
    index[i] = j >= count ? -1 : source != nullptr ? source[from] : static_cast<std::int32_t>(from);
  }
};

// Thread per slot: a row of the grouped layout (offsets') at its place in the block layout; -1 stays -1,
// and so does a row past its group's block (counted by BlockIndex).
struct BlockPositions {
  std::int64_t groups;
  std::int64_t block;
  const std::int64_t* offsets;   // [groups + 1]
  const std::int64_t* position;  // [T, k]
  std::int64_t* out;             // [T, k]
  CAPSERVE_HD void operator()(std::int64_t slot) const {
    const std::int64_t p = position[slot];
    if (p < 0) {
      out[slot] = -1;
      return;
    }
    std::int64_t lo = 0;  // the last group starting at or before p
    std::int64_t hi = groups - 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= p) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const std::int64_t j = p - offsets[lo];
    out[slot] = j < block ? lo * block + j : -1;
  }
};

// Thread per received entry place of the block layout (source s's entries in [s * entry_block, + counts[s]),
// its rows from s * row_block): as UnpackEntries, places past a source's count skipped.
struct UnpackBlockEntries {
  std::int64_t top_k;
  std::int64_t entry_block;
  std::int64_t row_block;
  const DispatchEntry* entries;  // [ranks * entry_block]
  const std::int64_t* counts;    // [ranks]: entries each source sent
  std::int32_t* experts;         // [ranks * row_block, k]
  float* weights;                // [ranks * row_block, k]
  CAPSERVE_HD void operator()(std::int64_t i) const {
    const std::int64_t source = i / entry_block;
    const std::int64_t first = source * entry_block;
    if (i - first >= counts[source]) return;
    const DispatchEntry en = entries[i];
    if (en.row < 0 || en.row >= row_block) return;
    std::int64_t slot = 0;
    for (std::int64_t j = i; j > first && entries[j - 1].row == en.row; --j) ++slot;
    const std::int64_t at = (source * row_block + en.row) * top_k + slot;
    experts[at] = en.local_expert;
    weights[at] = en.weight;
  }
};

// Thread per token: how many of its slots the capacity scheduler dropped and rerouted, added to its counts
// (a step sums them over its layers).
struct CountSlotStates {
  std::int64_t top_k;
  const std::uint8_t* status;  // [T, k]: SlotState
  std::int64_t* dropped;       // [T]
  std::int64_t* rerouted;      // [T]
  CAPSERVE_HD void operator()(std::int64_t t) const {
    std::int64_t d = 0;
    std::int64_t r = 0;
    for (std::int64_t s = 0; s < top_k; ++s) {
      const auto st = static_cast<SlotState>(status[t * top_k + s]);
      d += st == SlotState::dropped ? 1 : 0;
      r += st == SlotState::rerouted ? 1 : 0;
    }
    dropped[t] += d;
    rerouted[t] += r;
  }
};

// Thread per entry of experts [T, k]: the expert's id replaced by one of its copies (EPLB replication,
// parallel/expert_placement.h), expert e's copies being [first_copy[e], first_copy[e + 1]). Token t takes
// copy (t + salt) mod copies: a rank's tokens go to the copies in turn, and with the rank as the salt, ranks
// holding one token each (decode steps) spread over them too. Dropped entries (-1) stay dropped.
struct AssignCopies {
  std::int64_t top_k;
  std::int64_t salt;
  const std::int32_t* experts;     // [T, k]
  const std::int32_t* first_copy;  // [E + 1]
  std::int32_t* copies;            // [T, k]: out
  CAPSERVE_HD void operator()(std::int64_t i) const {
    const std::int32_t e = experts[i];
    if (e < 0) {
      copies[i] = -1;
      return;
    }
    const std::int64_t n = first_copy[e + 1] - first_copy[e];
    copies[i] = first_copy[e] + static_cast<std::int32_t>((i / top_k + salt) % n);
  }
};

// Thread per slot: counts[e] += 1 for the slot's expert e (none when dropped).
struct CountExperts {
  const std::int32_t* experts;
  std::int64_t* counts;
  CAPSERVE_HD void operator()(std::int64_t slot) const {
    if (experts[slot] >= 0) add_count(counts + experts[slot], 1);
  }
};

}  // namespace capserve::kernels::moe
