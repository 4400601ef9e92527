#pragma once
// An expert placement as tensors of a backend's device, uploaded once per model: what the capacity and
// dispatch kernels read about each layer (owners, local indices, this rank's slots, slots per rank, and with
// replication each expert's first slot).
#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "parallel/expert_placement.h"

namespace capserve::parallel {

// One layer's placement, int32 tensors of the backend.
// Indices are slots (ExpertPlacement): without replication, slot = expert.
struct LayerTables {
  kernels::Tensor owners;         // [S]: the rank hosting each slot
  kernels::Tensor local_index;    // [S]: its index among that rank's slots
  kernels::Tensor local_list;     // [this rank's slots]: ascending
  kernels::Tensor bin_experts;    // [ranks]: slots per rank
  kernels::Tensor first_slots;    // [E + 1]: expert e's copies are slots [first[e], first[e + 1]); empty
                                  // without replication
  std::int64_t peer_experts = 0;  // the most slots one rank hosts (host value)
  std::int64_t num_experts = 0;   // the router's experts (host value)
  int rank = 0;                   // the rank these tables are seen from
};

class PlacementTables {
 public:
  // Uploads every layer of `placement` as seen from `rank`.
  PlacementTables(kernels::Backend& backend, const ExpertPlacement& placement, int rank);

  [[nodiscard]] const LayerTables& layer(std::int64_t layer) const {
    return layers_.at(static_cast<std::size_t>(layer));
  }

 private:
  std::vector<std::int32_t> host_;  // every layer's four arrays back to back: the upload's source
  kernels::Buffer storage_;
  std::vector<LayerTables> layers_;
};

}  // namespace capserve::parallel
