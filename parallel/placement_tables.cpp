#include "parallel/placement_tables.h"

#include <algorithm>
#include <span>

namespace capserve::parallel {

PlacementTables::PlacementTables(kernels::Backend& backend, const ExpertPlacement& placement, int rank) {
  const std::int64_t layers = placement.num_layers();
  struct Range {
    std::size_t owners, local_index, local_list, bin_experts, first_slots, end;
    std::int64_t peer_experts;
  };
  std::vector<Range> ranges;
  for (std::int64_t l = 0; l < layers; ++l) {
    Range r{};
    r.owners = host_.size();
    host_.insert(host_.end(), placement.owners(l).begin(), placement.owners(l).end());
    r.local_index = host_.size();
    host_.insert(host_.end(), placement.local_index(l).begin(), placement.local_index(l).end());
    r.local_list = host_.size();
    host_.insert(host_.end(), placement.local_experts(l, rank).begin(),
                 placement.local_experts(l, rank).end());
    r.bin_experts = host_.size();
    r.peer_experts = 0;
    for (int q = 0; q < placement.num_ranks(); ++q) {
      const auto n = static_cast<std::int64_t>(placement.local_experts(l, q).size());
      host_.push_back(static_cast<std::int32_t>(n));
      r.peer_experts = std::max(r.peer_experts, n);
    }
    r.first_slots = host_.size();
    if (placement.replicated())
      host_.insert(host_.end(), placement.first_slots(l).begin(), placement.first_slots(l).end());
    r.end = host_.size();
    ranges.push_back(r);
  }
  storage_ = backend.allocate(host_.size() * sizeof(std::int32_t));
  const kernels::Tensor all = storage_.view(kernels::DType::i32, {static_cast<std::int64_t>(host_.size())});
  if (!host_.empty()) backend.from_host(std::as_bytes(std::span<const std::int32_t>(host_)), all);
  const auto part = [&all](std::size_t begin, std::size_t end) {
    return all.rows(static_cast<std::int64_t>(begin), static_cast<std::int64_t>(end - begin));
  };
  for (const Range& r : ranges) {
    const kernels::Tensor first_slots =
        r.end > r.first_slots ? part(r.first_slots, r.end) : kernels::Tensor{};
    layers_.push_back({part(r.owners, r.local_index), part(r.local_index, r.local_list),
                       part(r.local_list, r.bin_experts), part(r.bin_experts, r.first_slots), first_slots,
                       r.peer_experts, placement.num_experts(), rank});
  }
}

}  // namespace capserve::parallel
