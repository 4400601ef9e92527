#pragma once
// An expert placement as tensors of a backend's device, uploaded once per model: what the capacity and
// dispatch kernels read about each layer (owners, local indices, this rank's experts, experts per rank).
#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "parallel/expert_placement.h"

namespace capserve::parallel {

// One layer's placement, int32 tensors of the backend.
struct LayerTables {
  kernels::Tensor owners;         // [E]: the rank hosting each expert
  kernels::Tensor local_index;    // [E]: its index among that rank's experts
  kernels::Tensor local_list;     // [this rank's experts]: ascending
  kernels::Tensor bin_experts;    // [ranks]: experts per rank
  std::int64_t peer_experts = 0;  // the most experts one rank hosts (host value)
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
