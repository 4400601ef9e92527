#include "kernels/moe/host_executor.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace capserve::kernels::moe {
namespace {

// Runs each launch's threads in index order.
struct HostExec {
  static constexpr bool kReadsStateFreely = true;
  std::function<void(std::span<std::int64_t>)> allreduce_sum;

  template <class Body>
  void for_each(std::int64_t n, const Body& body) {
    for_each_on_host(n, body);
  }
  template <class T>
  void zero(T* data, std::int64_t n) {
    std::fill(data, data + n, T{});
  }
  void exclusive_scan(std::int64_t* data, std::int64_t n) {
    std::int64_t sum = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t v = data[i];
      data[i] = sum;
      sum += v;
    }
    data[n] = sum;
  }
  void reduce_sum(std::int64_t* data, std::int64_t n) {
    if (allreduce_sum) allreduce_sum(std::span<std::int64_t>(data, static_cast<std::size_t>(n)));
  }
};

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("moe index logic: " + what);
}

template <class T>
const T* or_null(std::span<const T> s) {
  return s.empty() ? nullptr : s.data();
}

}  // namespace

void route_on_host(const RouterParams& p, std::span<const float> logits, std::span<const float> bias,
                   std::span<float> probs, std::span<std::int32_t> experts, std::span<float> weights) {
  const auto rows = static_cast<std::size_t>(p.tokens);
  check(logits.size() >= rows * static_cast<std::size_t>(p.num_experts) &&
            probs.size() >= rows * static_cast<std::size_t>(p.num_experts) &&
            experts.size() >= rows * static_cast<std::size_t>(p.top_k) &&
            weights.size() >= rows * static_cast<std::size_t>(p.top_k),
        "router buffers smaller than the shapes");
  check(p.n_group >= 1 && p.n_group <= 64 && p.num_experts % p.n_group == 0, "router groups");
  check(p.group_score != GroupScore::top2_sum || p.num_experts / p.n_group >= 2,
        "groups ranked by their best two need two experts each");
  check(bias.empty() || bias.size() == static_cast<std::size_t>(p.num_experts),
        "one correction bias per expert");
  HostExec x;
  run_router(x, RouteToken{p, logits.data(), bias.empty() ? nullptr : bias.data(), probs.data(),
                           experts.data(), weights.data()});
}

CapacityTotals schedule_capacity_on_host(const CapacityInputs& in, std::span<std::int32_t> experts,
                                         std::span<float> weights, std::span<std::uint8_t> status) {
  const CapacityParams& p = in.params;
  const auto slots = static_cast<std::size_t>(p.tokens * p.top_k);
  check(experts.size() >= slots && weights.size() >= slots && status.size() >= slots,
        "routing buffers smaller than tokens * top_k");
  check(in.probs.size() >= static_cast<std::size_t>(p.tokens * p.num_experts), "probs smaller than [T, E]");
  check(in.owners.empty() == in.bin_experts.empty(), "device granularity needs owners and bin_experts");
  check(static_cast<std::uint64_t>(p.total_tokens) * static_cast<std::uint64_t>(p.top_k) <= kLow32,
        "more than 2^32 assignments in one step");
  const CapacityWorkspace layout = capacity_workspace(p);
  std::vector<std::uint64_t> own;
  std::vector<std::uint64_t>& workspace = in.workspace != nullptr ? *in.workspace : own;
  const auto words = static_cast<std::size_t>((layout.bytes + 7) / 8) + 2;
  if (workspace.size() < words) workspace.resize(words);
  CapacityView v;
  v.p = p;
  v.probs = in.probs.data();
  v.exempt = or_null(in.exempt);
  v.owners = or_null(in.owners);
  v.bin_experts = or_null(in.bin_experts);
  v.local_list = or_null(in.local_list);
  v.num_local = static_cast<std::int64_t>(in.local_list.size());
  v.experts = experts.data();
  v.weights = weights.data();
  v.status = status.data();
  // std::vector<uint64_t> storage is 8-byte aligned; the arrays need 16 at most for SelectState.
  auto* base = reinterpret_cast<unsigned char*>(workspace.data());
  base += (16 - reinterpret_cast<std::uintptr_t>(base) % 16) % 16;
  bind_capacity_workspace(v, base);
  HostExec x{in.allreduce_sum};
  run_capacity(x, v);
  return {v.totals[0], v.totals[1]};
}

PermuteResult permute_on_host(const PermuteParams& p, std::span<const std::int32_t> experts,
                              std::span<const std::int32_t> owners,
                              std::span<const std::int32_t> local_index) {
  const auto slots = static_cast<std::size_t>(p.tokens * p.top_k);
  check(experts.size() >= slots, "experts smaller than tokens * top_k");
  check(owners.empty() == local_index.empty(), "owners and local_index go together");
  check(p.chunk > 0, "chunk must be positive");
  PermuteResult r;
  r.offsets.resize(static_cast<std::size_t>(p.num_groups + 1));
  r.position.resize(slots);
  r.row_token.resize(slots);
  std::vector<std::int64_t> chunk_base(static_cast<std::size_t>(p.num_groups * permute_chunks(p) + 1));
  PermuteView v;
  v.p = p;
  v.experts = experts.data();
  v.owners = or_null(owners);
  v.local_index = or_null(local_index);
  v.chunk_base = chunk_base.data();
  v.offsets = r.offsets.data();
  v.position = r.position.data();
  v.row_token = r.row_token.data();
  HostExec x;
  run_permute(x, v);
  r.row_token.resize(static_cast<std::size_t>(r.offsets.back()));
  return r;
}

void plan_dispatch_on_host(const DispatchPlanView& v) {
  HostExec x;
  run_plan_dispatch(x, v);
}

void group_received_on_host(const ReceivedView& v) {
  HostExec x;
  run_group_received(x, v);
}

void group_received_blocks_on_host(const ReceivedBlocksView& v) {
  HostExec x;
  run_group_received_blocks(x, v);
}

}  // namespace capserve::kernels::moe
