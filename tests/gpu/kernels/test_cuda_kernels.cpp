// The CUDA kernels against the CPU path on fresh random inputs (METHOD.md): the index kernels (router top-k,
// capacity scheduler, permute) decision for decision, the arithmetic ones by ||out - ref|| / ||ref|| — fp32
// kernels under 1e-5, bf16 GEMMs under 1e-2. Every output is poisoned (all bits set: NaN / -1) before the
// run, so an unwritten element fails. Skipped where no CUDA device is usable.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/expert_ffn.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/latent_attention.h"
#include "kernels/cuda/layer_kernels.h"
#include "kernels/cuda/linear.h"
#include "kernels/cuda/moe_kernels.h"
#include "kernels/cuda/row_kernels.h"
#include "kernels/moe/host_executor.h"
#include "parallel/capacity_stage.h"
#include "parallel/expert_placement.h"
#include "parallel/self_communicator.h"
#include "runtime/sampler.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/support/capacity_layer.h"

namespace capserve {
namespace {

namespace moe = kernels::moe;
using kernels::cuda::DeviceBuffer;
using Rng = std::mt19937_64;

template <class T>
DeviceBuffer<T> upload(const std::vector<T>& host) {
  DeviceBuffer<T> d(host.size());
  if (!host.empty())
    CAPSERVE_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> download(const DeviceBuffer<T>& d, std::size_t n) {
  CAPSERVE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> host(n);
  if (n > 0) CAPSERVE_CUDA_CHECK(cudaMemcpy(host.data(), d.data(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

template <class T>
DeviceBuffer<T> poisoned(std::size_t n) {
  DeviceBuffer<T> d(n);
  if (n > 0) CAPSERVE_CUDA_CHECK(cudaMemset(d.data(), 0xFF, d.bytes()));
  return d;
}

std::int64_t uniform(Rng& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

using test::normal_vector;
using test::relative_error;

std::uint16_t to_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}
float from_bf16(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

const __nv_bfloat16* bf16_ptr(const DeviceBuffer<std::uint16_t>& d) {
  return reinterpret_cast<const __nv_bfloat16*>(d.data());
}

kernels::Tensor bf16_view(const std::vector<std::uint16_t>& bits, std::int64_t rows, std::int64_t cols) {
  return kernels::weight_tensor(
      {kernels::DType::bf16, reinterpret_cast<const std::byte*>(bits.data()), rows, cols});
}

// ---------------------------------------------------------------------------------------------------------

TEST(CudaKernels, RouterMatchesTheCpuRouter) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t E = uniform(rng, 2, 128);
    const std::int64_t k = uniform(rng, 1, std::min<std::int64_t>(E, 8));
    const std::int64_t T = uniform(rng, 1, 500);
    const bool normalize = uniform(rng, 0, 1) == 1;
    const std::vector<float> logits = normal_vector(rng, static_cast<std::size_t>(T * E), 3.0F);
    const testing::HostRouting cpu = testing::route_softmax(logits, T, E, k, normalize);

    moe::RouterParams p;
    p.tokens = T;
    p.num_experts = E;
    p.top_k = k;
    p.normalize = normalize;
    const auto d_logits = upload(logits);
    auto d_probs = poisoned<float>(static_cast<std::size_t>(T * E));
    auto d_experts = poisoned<std::int32_t>(static_cast<std::size_t>(T * k));
    auto d_weights = poisoned<float>(static_cast<std::size_t>(T * k));
    kernels::cuda::route(p, d_logits.data(), nullptr, d_probs.data(), d_experts.data(), d_weights.data(),
                         nullptr);
    const std::vector<float> probs = download(d_probs, d_probs.size());
    const std::vector<std::int32_t> experts = download(d_experts, d_experts.size());
    const std::vector<float> weights = download(d_weights, d_weights.size());
    EXPECT_LT(relative_error(probs, cpu.probs), 1e-5);
    EXPECT_LT(relative_error(weights, cpu.weights), 1e-5);
    // The device's expf may differ from the host's in the last bit: a different choice is allowed only
    // between experts the CPU scores within rounding of each other.
    for (std::size_t a = 0; a < experts.size(); ++a) {
      if (experts[a] == cpu.experts[a]) continue;
      const std::size_t t = a / static_cast<std::size_t>(k);
      ASSERT_GE(experts[a], 0);
      const float p_gpu = cpu.probs[t * static_cast<std::size_t>(E) + static_cast<std::size_t>(experts[a])];
      const float p_cpu =
          cpu.probs[t * static_cast<std::size_t>(E) + static_cast<std::size_t>(cpu.experts[a])];
      EXPECT_NEAR(p_gpu, p_cpu, 1e-6F * p_cpu)
          << "token " << t << " slot " << a % static_cast<std::size_t>(k);
    }
  }
}

// The sigmoid router (group-limited, normalised, scaled) on the device against the CPU's run of the same
// logic (the host executor of moe_index_logic.h); the definition itself is checked in test_sigmoid_router.
TEST(CudaKernels, SigmoidRouterMatchesTheCpu) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(17);
  for (int trial = 0; trial < 20; ++trial) {
    moe::RouterParams p;
    p.score = moe::RouterScore::sigmoid;
    p.n_group = std::int64_t{1} << uniform(rng, 0, 3);
    p.num_experts = p.n_group * uniform(rng, 2, 16);
    p.topk_group = uniform(rng, 1, p.n_group);
    p.top_k = uniform(rng, 1, std::min<std::int64_t>(8, p.topk_group * (p.num_experts / p.n_group)));
    p.tokens = uniform(rng, 1, 300);
    p.normalize = uniform(rng, 0, 1) == 1;
    p.scaling = uniform(rng, 0, 1) == 1 ? 2.5F : 1.0F;
    const std::vector<float> logits =
        normal_vector(rng, static_cast<std::size_t>(p.tokens * p.num_experts), 3.0F);
    std::vector<float> cpu_probs(logits.size());
    std::vector<std::int32_t> cpu_experts(static_cast<std::size_t>(p.tokens * p.top_k));
    std::vector<float> cpu_weights(cpu_experts.size());
    moe::route_on_host(p, logits, {}, cpu_probs, cpu_experts, cpu_weights);
    const auto d_logits = upload(logits);
    auto d_probs = poisoned<float>(logits.size());
    auto d_experts = poisoned<std::int32_t>(cpu_experts.size());
    auto d_weights = poisoned<float>(cpu_weights.size());
    kernels::cuda::route(p, d_logits.data(), nullptr, d_probs.data(), d_experts.data(), d_weights.data(),
                         nullptr);
    EXPECT_LT(relative_error(download(d_probs, logits.size()), cpu_probs), 1e-6) << "trial " << trial;
    EXPECT_LT(relative_error(download(d_weights, cpu_weights.size()), cpu_weights), 1e-5)
        << "trial " << trial;
    const std::vector<std::int32_t> experts = download(d_experts, cpu_experts.size());
    // As for softmax: a different choice only between experts scored within rounding of each other.
    for (std::size_t a = 0; a < experts.size(); ++a) {
      if (experts[a] == cpu_experts[a]) continue;
      const std::size_t row = a / static_cast<std::size_t>(p.top_k) * static_cast<std::size_t>(p.num_experts);
      ASSERT_GE(experts[a], 0);
      EXPECT_NEAR(cpu_probs[row + static_cast<std::size_t>(experts[a])],
                  cpu_probs[row + static_cast<std::size_t>(cpu_experts[a])], 1e-6F)
          << "trial " << trial << " slot " << a;
    }
  }
}

// The warp router against the host's run of RouteToken, exactly: integer logits (ties everywhere, which go to
// the lower id), NaN logits (a NaN first logit is the row's maximum; a NaN expert is never preferred), and
// DeepSeek-V3's shape (256 sigmoid experts, 8 groups ranked by their best two, a correction bias, scaling);
// beyond 2048 experts the thread router still serves.
TEST(CudaKernels, WarpRouterFollowsTheHostRuleOnTiesNansAndDeepSeekV3Shapes) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(29);
  struct Case {
    const char* name;
    moe::RouterParams p;
    bool with_bias;
  };
  const auto params = [](std::int64_t T, std::int64_t E, std::int64_t k, moe::RouterScore score) {
    moe::RouterParams p;
    p.tokens = T;
    p.num_experts = E;
    p.top_k = k;
    p.score = score;
    return p;
  };
  std::vector<Case> cases = {
      {"softmax ties", params(100, 64, 6, moe::RouterScore::softmax), false},
      {"deepseek-v3", params(70, 256, 8, moe::RouterScore::sigmoid), true},
      {"softmax with NaN", params(8, 40, 4, moe::RouterScore::softmax), false},
      {"thread router beyond 2048 experts", params(5, 3000, 2, moe::RouterScore::softmax), false}};
  cases[0].p.normalize = true;
  cases[1].p.n_group = 8;
  cases[1].p.topk_group = 4;
  cases[1].p.group_score = moe::GroupScore::top2_sum;
  cases[1].p.normalize = true;
  cases[1].p.scaling = 2.5F;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const moe::RouterParams& p = c.p;
    std::vector<float> logits(static_cast<std::size_t>(p.tokens * p.num_experts));
    for (float& l : logits) l = static_cast<float>(uniform(rng, -3, 3)) / 2.0F;
    if (std::string(c.name) == "softmax with NaN") {
      logits[static_cast<std::size_t>(3 * p.num_experts)] = NAN;       // row 3: its first logit
      logits[static_cast<std::size_t>(5 * p.num_experts + 17)] = NAN;  // row 5: one in the middle
    }
    std::vector<float> bias;
    if (c.with_bias) {
      bias.resize(static_cast<std::size_t>(p.num_experts));
      for (float& b : bias) b = static_cast<float>(uniform(rng, 0, 4)) / 8.0F;
    }
    std::vector<float> cpu_probs(logits.size());
    std::vector<std::int32_t> cpu_experts(static_cast<std::size_t>(p.tokens * p.top_k));
    std::vector<float> cpu_weights(cpu_experts.size());
    moe::route_on_host(p, logits, bias, cpu_probs, cpu_experts, cpu_weights);
    const auto d_logits = upload(logits);
    const auto d_bias = upload(bias);
    auto d_probs = poisoned<float>(logits.size());
    auto d_experts = poisoned<std::int32_t>(cpu_experts.size());
    auto d_weights = poisoned<float>(cpu_weights.size());
    kernels::cuda::route(p, d_logits.data(), c.with_bias ? d_bias.data() : nullptr, d_probs.data(),
                         d_experts.data(), d_weights.data(), nullptr);
    EXPECT_EQ(download(d_experts, cpu_experts.size()), cpu_experts);
    const std::vector<float> weights = download(d_weights, cpu_weights.size());
    for (std::size_t i = 0; i < weights.size(); ++i) {
      if (std::isnan(cpu_weights[i])) {
        EXPECT_TRUE(std::isnan(weights[i])) << "slot " << i;
      } else {
        EXPECT_NEAR(weights[i], cpu_weights[i], 1e-6F * std::abs(cpu_weights[i])) << "slot " << i;
      }
    }
  }
}

TEST(CudaKernels, RouterRejectsGroupLimitsItCannotMeet) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  moe::RouterParams p;
  p.tokens = 3;
  p.num_experts = 8;
  p.n_group = 4;  // groups of 2 experts
  p.top_k = 2;
  const auto d_logits = upload(std::vector<float>(24, 1.0F));
  auto d_probs = poisoned<float>(24);
  auto d_experts = poisoned<std::int32_t>(12);
  auto d_weights = poisoned<float>(12);
  const auto route = [&](std::int64_t topk_group, std::int64_t top_k) {
    p.topk_group = topk_group;
    p.top_k = top_k;
    kernels::cuda::route(p, d_logits.data(), nullptr, d_probs.data(), d_experts.data(), d_weights.data(),
                         nullptr);
  };
  // No group (the body would read prob[-1]), more groups than exist, fewer eligible experts than top_k.
  EXPECT_THROW(route(0, 2), std::invalid_argument);
  EXPECT_THROW(route(5, 2), std::invalid_argument);
  EXPECT_THROW(route(2, 5), std::invalid_argument);
  route(2, 4);
  for (const std::int32_t e : download(d_experts, 12)) EXPECT_GE(e, 0);
}

TEST(CudaKernels, CapacityStageDecisionsAreBitIdentical) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(23);
  static constexpr double kGammas[] = {0.25, 0.5, 1.0 / 3.0, 0.75, 1.0, 1.25, 2.0};
  static constexpr parallel::CapacityPolicy kPolicies[] = {
      parallel::CapacityPolicy::drop, parallel::CapacityPolicy::reroute, parallel::CapacityPolicy::expanded};
  static constexpr parallel::DropScore kScores[] = {parallel::DropScore::gate, parallel::DropScore::order,
                                                    parallel::DropScore::reverse_order,
                                                    parallel::DropScore::random};
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t E = uniform(rng, 1, 64);
    const std::int64_t k = uniform(rng, 1, std::min<std::int64_t>(E, 8));
    const std::int64_t T = uniform(rng, 0, 10) == 0 ? 0 : uniform(rng, 1, 1000);
    const int ranks = static_cast<int>(uniform(rng, 1, 4));
    const int rank = static_cast<int>(uniform(rng, 0, ranks - 1));
    parallel::CapacityConfig config;
    config.gamma = {kGammas[uniform(rng, 0, std::ssize(kGammas) - 1)]};
    config.policy = kPolicies[uniform(rng, 0, 2)];
    config.granularity = uniform(rng, 0, 1) == 1 ? parallel::CapacityGranularity::device
                                                 : parallel::CapacityGranularity::expert;
    config.scope = parallel::CapacityScope::local;
    config.score = kScores[uniform(rng, 0, 3)];
    config.rounds = uniform(rng, 1, 3);
    config.local_experts = uniform(rng, 1, 3);
    config.renormalize_after_drop = uniform(rng, 0, 3) == 0;
    config.seed = 42;
    const bool normalized = uniform(rng, 0, 1) == 1;
    // Logits on a grid: many exact ties.
    std::vector<float> logits(static_cast<std::size_t>(T * E));
    for (float& l : logits) l = static_cast<float>(uniform(rng, 0, 3)) * 0.5F;
    const testing::HostRouting routing = testing::route_softmax(logits, T, E, k, normalized);
    const parallel::ExpertPlacement placement = parallel::ExpertPlacement::contiguous(1, E, ranks);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": T=" + std::to_string(T) + " E=" + std::to_string(E) +
                 " k=" + std::to_string(k) + " " + parallel::describe(config));

    // CPU: with one rank, CapacityStage itself; with more, rank `rank` in local scope, which the host
    // emulation below stands for (it equals CapacityStage bit for bit: unit test test_moe_index_logic).
    std::vector<std::int32_t> cpu_experts = routing.experts;
    std::vector<float> cpu_weights = routing.weights;
    std::vector<parallel::SlotStatus> cpu_status(cpu_experts.size());
    if (ranks == 1) {
      parallel::SelfCommunicator self;
      parallel::CapacityStage scheduler(config, self);
      scheduler.begin_step(T);
      testing::apply_layer(scheduler, 0, placement, 0, T, k, routing.probs, cpu_experts, cpu_weights,
                           cpu_status, {}, normalized, 1.0F);
    }

    // Device.
    const bool device = config.granularity == parallel::CapacityGranularity::device;
    moe::CapacityView v;
    v.p.tokens = T;
    v.p.top_k = k;
    v.p.num_experts = E;
    v.p.nbins = device ? ranks : E;
    v.p.total_tokens = T;
    v.p.gamma = config.gamma.front();
    v.p.reroute = config.policy == parallel::CapacityPolicy::drop      ? moe::RerouteKind::none
                  : config.policy == parallel::CapacityPolicy::reroute ? moe::RerouteKind::reroute
                                                                       : moe::RerouteKind::expanded;
    v.p.rounds = config.rounds;
    v.p.local_experts = config.local_experts;
    v.p.score = static_cast<moe::ScoreKind>(static_cast<int>(config.score));
    v.p.seed = config.seed;
    v.p.normalized = normalized;
    v.p.renormalize_after_drop = config.renormalize_after_drop;
    std::vector<std::int32_t> bin_experts;
    for (int r = 0; r < ranks; ++r)
      bin_experts.push_back(static_cast<std::int32_t>(placement.local_experts(0, r).size()));
    const std::vector<std::int32_t> owners(placement.owners(0).begin(), placement.owners(0).end());
    const std::vector<std::int32_t> local(placement.local_experts(0, rank).begin(),
                                          placement.local_experts(0, rank).end());
    const auto d_probs = upload(routing.probs);
    const auto d_owners = upload(owners);
    const auto d_bin_experts = upload(bin_experts);
    const auto d_local = upload(local);
    auto d_experts = upload(routing.experts);
    auto d_weights = upload(routing.weights);
    auto d_status = poisoned<std::uint8_t>(routing.experts.size());
    DeviceBuffer<std::byte> workspace(static_cast<std::size_t>(kernels::cuda::capacity_workspace_bytes(v.p)));
    auto d_totals = poisoned<std::int64_t>(2);
    v.probs = d_probs.data();
    v.owners = device ? d_owners.data() : nullptr;
    v.bin_experts = device ? d_bin_experts.data() : nullptr;
    v.local_list = d_local.data();
    v.num_local = static_cast<std::int64_t>(local.size());
    v.experts = d_experts.data();
    v.weights = d_weights.data();
    v.status = d_status.data();
    kernels::cuda::schedule_capacity(v, workspace.data(), d_totals.data(), nullptr);

    // Reference: the host emulation of the same parameters.
    moe::CapacityInputs in;
    in.params = v.p;
    in.probs = routing.probs;
    if (device) {
      in.owners = owners;
      in.bin_experts = bin_experts;
    }
    in.local_list = local;
    std::vector<std::int32_t> ref_experts = routing.experts;
    std::vector<float> ref_weights = routing.weights;
    std::vector<std::uint8_t> ref_status(ref_experts.size());
    const moe::CapacityTotals ref_totals =
        moe::schedule_capacity_on_host(in, ref_experts, ref_weights, ref_status);
    if (ranks == 1) {
      ASSERT_EQ(ref_experts, cpu_experts);
      for (std::size_t a = 0; a < cpu_status.size(); ++a)
        ASSERT_EQ(ref_status[a], static_cast<std::uint8_t>(cpu_status[a]));
    }

    ASSERT_EQ(download(d_status, ref_status.size()), ref_status);
    ASSERT_EQ(download(d_experts, ref_experts.size()), ref_experts);
    const std::vector<float> weights = download(d_weights, ref_weights.size());
    for (std::size_t a = 0; a < weights.size(); ++a)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(weights[a]), std::bit_cast<std::uint32_t>(ref_weights[a])) << a;
    const std::vector<std::int64_t> totals = download(d_totals, 2);
    EXPECT_EQ(totals[0], ref_totals.dropped);
    EXPECT_EQ(totals[1], ref_totals.rerouted);
  }
}

TEST(CudaKernels, PermuteGatherAndCombineMatchTheHost) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(31);
  for (int trial = 0; trial < 30; ++trial) {
    const std::int64_t E = uniform(rng, 1, 64);
    const std::int64_t k = uniform(rng, 1, std::min<std::int64_t>(E, 8));
    const std::int64_t T = uniform(rng, 1, 2000);
    const std::int64_t hidden = uniform(rng, 1, 300);
    std::vector<std::int32_t> experts(static_cast<std::size_t>(T * k));
    for (auto& e : experts)
      e = uniform(rng, 0, 5) == 0 ? -1 : static_cast<std::int32_t>(uniform(rng, 0, E - 1));
    moe::PermuteParams p;
    p.tokens = T;
    p.top_k = k;
    p.num_groups = E;
    p.chunk = uniform(rng, 1, 512);
    const moe::PermuteResult ref = moe::permute_on_host(p, experts, {}, {});

    const auto d_experts = upload(experts);
    DeviceBuffer<std::int64_t> workspace(
        static_cast<std::size_t>(kernels::cuda::permute_workspace_elements(p)));
    auto d_offsets = poisoned<std::int64_t>(static_cast<std::size_t>(E + 1));
    auto d_position = poisoned<std::int64_t>(experts.size());
    auto d_row_token = poisoned<std::int32_t>(experts.size());
    kernels::cuda::permute(p, d_experts.data(), nullptr, nullptr, workspace.data(), d_offsets.data(),
                           d_position.data(), d_row_token.data(), nullptr);
    ASSERT_EQ(download(d_offsets, ref.offsets.size()), ref.offsets);
    ASSERT_EQ(download(d_position, ref.position.size()), ref.position);
    std::vector<std::int32_t> row_token = download(d_row_token, experts.size());
    row_token.resize(ref.row_token.size());
    ASSERT_EQ(row_token, ref.row_token);

    // Gather to bf16 rows, then combine fp32 expert outputs back with the gate weights.
    const std::int64_t rows = ref.offsets.back();
    const std::vector<float> h = normal_vector(rng, static_cast<std::size_t>(T * hidden));
    const auto d_h = upload(h);
    auto d_x = poisoned<__nv_bfloat16>(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * hidden));
    kernels::cuda::gather_rows(d_h.data(), hidden, d_row_token.data(), d_offsets.data() + E, T * k,
                               d_x.data(), nullptr);
    std::vector<__nv_bfloat16> x = download(d_x, static_cast<std::size_t>(rows * hidden));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < hidden; ++c) {
        const float want = from_bf16(
            to_bf16(h[static_cast<std::size_t>(ref.row_token[static_cast<std::size_t>(r)] * hidden + c)]));
        ASSERT_EQ(__bfloat162float(x[static_cast<std::size_t>(r * hidden + c)]), want);
      }
    }
    const std::vector<float> y =
        normal_vector(rng, static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * hidden));
    std::vector<float> weights(experts.size());
    for (float& w : weights) w = std::uniform_real_distribution<float>(0.0F, 1.0F)(rng);
    const auto d_y = upload(y);
    const auto d_w = upload(weights);
    auto d_out = poisoned<float>(static_cast<std::size_t>(T * hidden));
    kernels::cuda::combine(d_y.data(), hidden, d_position.data(), d_w.data(), T, k, d_out.data(), nullptr);
    std::vector<float> want(static_cast<std::size_t>(T * hidden), 0.0F);
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t s = 0; s < k; ++s) {
        const std::int64_t row = ref.position[static_cast<std::size_t>(t * k + s)];
        if (row < 0) continue;
        for (std::int64_t c = 0; c < hidden; ++c)
          want[static_cast<std::size_t>(t * hidden + c)] +=
              weights[static_cast<std::size_t>(t * k + s)] * y[static_cast<std::size_t>(row * hidden + c)];
      }
    }
    const std::vector<float> out = download(d_out, want.size());
    for (const float o : out) ASSERT_TRUE(std::isfinite(o));
    EXPECT_LT(relative_error(out, want), 1e-5);
  }
}

TEST(CudaKernels, GroupedExpertFfnMatchesTheCpuBackend) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(41);
  kernels::cpu::CpuBackend cpu(2);
  kernels::cuda::ExpertFfn ffn_gpu;
  for (int trial = 0; trial < 6; ++trial) {
    const std::int64_t E = uniform(rng, 1, 16);
    const std::int64_t hidden = 64 * uniform(rng, 1, 8);
    const std::int64_t ffn = 32 * uniform(rng, 1, 8);
    std::vector<std::int64_t> offsets{0};
    for (std::int64_t e = 0; e < E; ++e)
      offsets.push_back(offsets.back() + (uniform(rng, 0, 3) == 0 ? 0 : uniform(rng, 1, 200)));
    const std::int64_t rows = offsets.back();
    const float scale_in = 1.0F / std::sqrt(static_cast<float>(hidden));
    const float scale_ffn = 1.0F / std::sqrt(static_cast<float>(ffn));
    std::vector<std::vector<std::uint16_t>> gate(static_cast<std::size_t>(E)), up(gate.size()),
        down(gate.size());
    std::vector<kernels::ExpertWeights> cpu_experts;
    std::vector<DeviceBuffer<std::uint16_t>> d_weights;
    std::vector<kernels::cuda::DeviceExpert> gpu_experts;
    const auto bf16_random = [&](std::int64_t n, float sd) {
      std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
      const std::vector<float> values = normal_vector(rng, v.size(), sd);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = to_bf16(values[i]);
      return v;
    };
    for (std::int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<std::size_t>(e);
      gate[i] = bf16_random(ffn * hidden, scale_in);
      up[i] = bf16_random(ffn * hidden, scale_in);
      down[i] = bf16_random(hidden * ffn, scale_ffn);
      cpu_experts.push_back(
          {bf16_view(gate[i], ffn, hidden), bf16_view(up[i], ffn, hidden), bf16_view(down[i], hidden, ffn)});
    }
    for (std::int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<std::size_t>(e);
      d_weights.push_back(upload(gate[i]));
      d_weights.push_back(upload(up[i]));
      d_weights.push_back(upload(down[i]));
    }
    for (std::int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<std::size_t>(3 * e);
      gpu_experts.push_back({bf16_ptr(d_weights[i]), bf16_ptr(d_weights[i + 1]), bf16_ptr(d_weights[i + 2])});
    }
    // The same bf16-representable input on both sides.
    std::vector<float> x = normal_vector(rng, static_cast<std::size_t>(rows * hidden));
    std::vector<std::uint16_t> x_bits(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      x_bits[i] = to_bf16(x[i]);
      x[i] = from_bf16(x_bits[i]);
    }
    std::vector<float> ref(x.size());
    cpu.grouped_expert_ffn(kernels::Tensor::host(std::span(x), {rows, hidden}), offsets, cpu_experts,
                           kernels::Tensor::host(std::span(ref), {rows, hidden}));

    const auto d_x = upload(x_bits);
    auto d_out = poisoned<float>(x.size());
    DeviceBuffer<std::byte> workspace(
        static_cast<std::size_t>(kernels::cuda::ExpertFfn::workspace_bytes(rows, ffn)));
    ffn_gpu.run(bf16_ptr(d_x), offsets, gpu_experts, hidden, ffn, d_out.data(), workspace.data(), nullptr);
    const double err = relative_error(download(d_out, x.size()), ref);
    EXPECT_LT(err, 1e-2) << "E=" << E << " hidden=" << hidden << " ffn=" << ffn << " rows=" << rows;
  }
}

TEST(CudaKernels, RmsNormAndRopeMatchTheCpuBackend) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(53);
  kernels::cpu::CpuBackend cpu(2);
  const std::int64_t rows = 37;
  const std::int64_t cols = 1000;
  const std::vector<float> x = normal_vector(rng, static_cast<std::size_t>(rows * cols));
  std::vector<std::uint16_t> w(static_cast<std::size_t>(cols));
  const std::vector<float> wv = normal_vector(rng, w.size());
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = to_bf16(wv[i]);
  std::vector<float> ref(x.size());
  cpu.rms_norm(kernels::Tensor::host(std::span(x), {rows, cols}), bf16_view(w, 1, cols), 1e-6F,
               kernels::Tensor::host(std::span(ref), {rows, cols}));
  const auto d_x = upload(x);
  const auto d_w = upload(w);
  auto d_out = poisoned<float>(x.size());
  kernels::cuda::rms_norm(d_x.data(), rows, cols, d_w.data(), kernels::DType::bf16, 1e-6F, d_out.data(),
                          nullptr);
  EXPECT_LT(relative_error(download(d_out, x.size()), ref), 1e-5);

  for (const bool interleaved : {false, true}) {
    const kernels::RotaryLayout layout{5, 96, 32, 64, interleaved};
    const std::int64_t tokens = 19;
    const std::vector<float> q =
        normal_vector(rng, static_cast<std::size_t>(tokens * layout.heads * layout.head_dim));
    std::vector<float> cos(static_cast<std::size_t>(tokens * layout.dim / 2));
    std::vector<float> sin(cos.size());
    for (std::size_t i = 0; i < cos.size(); ++i) {
      const double angle = 0.37 * static_cast<double>(i);
      cos[i] = static_cast<float>(std::cos(angle));
      sin[i] = static_cast<float>(std::sin(angle));
    }
    std::vector<float> want = q;
    cpu.rope(kernels::Tensor::host(std::span(want), {tokens, layout.heads * layout.head_dim}), layout,
             kernels::Tensor::host(std::span(cos), {tokens, layout.dim / 2}),
             kernels::Tensor::host(std::span(sin), {tokens, layout.dim / 2}));
    auto d_q = upload(q);
    const auto d_cos = upload(cos);
    const auto d_sin = upload(sin);
    kernels::cuda::rope(d_q.data(), tokens, layout, d_cos.data(), d_sin.data(), nullptr);
    EXPECT_LT(relative_error(download(d_q, q.size()), want), 1e-6) << "interleaved=" << interleaved;
  }
}

TEST(CudaKernels, PagedAttentionMatchesTheCpuBackend) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(67);
  kernels::cpu::CpuBackend cpu(2);
  for (const std::int64_t window : {std::int64_t{0}, std::int64_t{7}}) {
    const std::int64_t heads = 8;
    const std::int64_t kv_heads = 2;
    const std::int64_t d = 64;
    const std::int64_t block_size = 4;
    const std::int64_t num_blocks = 64;
    const std::int64_t width = kv_heads * d;
    // A prefill of 13 tokens, a decode at position 20, and a chunk of 5 continuing at position 9.
    std::vector<std::vector<std::int32_t>> tables(3);
    std::vector<std::int32_t> free_blocks(static_cast<std::size_t>(num_blocks));
    std::iota(free_blocks.begin(), free_blocks.end(), 0);
    std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
    const std::int64_t starts[] = {0, 20, 9};
    const std::int64_t counts[] = {13, 1, 5};
    std::vector<kernels::SequenceSlice> seqs;
    std::int64_t row = 0;
    std::size_t next_block = 0;
    for (std::size_t s = 0; s < 3; ++s) {
      const std::int64_t context = starts[s] + counts[s];
      for (std::int64_t b = 0; b < (context + block_size - 1) / block_size; ++b)
        tables[s].push_back(free_blocks[next_block++]);
      seqs.push_back({row, counts[s], starts[s], tables[s]});
      row += counts[s];
    }
    const std::int64_t rows = row;
    std::vector<float> cache_k =
        normal_vector(rng, static_cast<std::size_t>(num_blocks * block_size * width));
    std::vector<float> cache_v = normal_vector(rng, cache_k.size());
    const std::vector<float> k = normal_vector(rng, static_cast<std::size_t>(rows * width));
    const std::vector<float> v = normal_vector(rng, k.size());
    const std::vector<float> q = normal_vector(rng, static_cast<std::size_t>(rows * heads * d));
    const kernels::AttentionParams params{heads, 1.0F / std::sqrt(static_cast<float>(d)), window};

    const kernels::cuda::AttentionBatchArrays arrays = kernels::cuda::attention_batch_arrays(seqs);
    const auto d_pos = upload(arrays.row_pos);
    const auto d_seq = upload(arrays.row_seq);
    const auto d_tables = upload(arrays.block_tables);
    auto d_cache_k = upload(cache_k);
    auto d_cache_v = upload(cache_v);
    const auto d_k = upload(k);
    const auto d_v = upload(v);
    const auto d_q = upload(q);
    auto d_out = poisoned<float>(q.size());
    const kernels::cuda::DeviceAttentionBatch batch{rows, d_pos.data(), d_seq.data(), d_tables.data(),
                                                    arrays.max_blocks};
    const kernels::cuda::DeviceKvLayer layer{d_cache_k.data(), d_cache_v.data(), kernels::DType::f32,
                                             block_size,       kv_heads,         d};
    kernels::cuda::kv_store(batch, d_k.data(), d_v.data(), layer, nullptr);
    kernels::cuda::paged_attention(batch, d_q.data(), layer, params, d_out.data(), nullptr);

    const kernels::PagedKvLayer cpu_layer{
        kernels::Tensor::host(std::span(cache_k), {num_blocks, block_size, kv_heads, d}),
        kernels::Tensor::host(std::span(cache_v), {num_blocks, block_size, kv_heads, d}), block_size,
        kv_heads, d};
    cpu.kv_store(seqs, kernels::Tensor::host(std::span(k), {rows, width}),
                 kernels::Tensor::host(std::span(v), {rows, width}), cpu_layer);
    std::vector<float> ref(q.size());
    cpu.paged_attention(seqs, kernels::Tensor::host(std::span(q), {rows, heads * d}), cpu_layer, params,
                        kernels::Tensor::host(std::span(ref), {rows, heads * d}));
    EXPECT_EQ(download(d_cache_k, cache_k.size()), cache_k);
    EXPECT_EQ(download(d_cache_v, cache_v.size()), cache_v);
    EXPECT_LT(relative_error(download(d_out, q.size()), ref), 1e-5) << "window " << window;
  }
}

// The tensor-core attention against attention in double over the same bf16 cache: grouped-query shapes
// (one to sixteen heads per K/V head, 16- and 64-row tiles), a sliding window, a decode-only batch, and the
// latent layout (values are the keys' first dims, every head one group), contexts of several 64-key tiles.
// The probabilities are rounded to bf16 for the products (the queries enter as two bf16 halves): 4e-4 to
// 1.1e-3 here, hence 2e-3.
struct FlashCase {
  const char* name;
  std::int64_t heads, kv_heads, dk, dv, window, block_size;
  bool values_in_keys;
  std::vector<std::int64_t> starts, counts;
};

TEST(CudaKernels, FlashAttentionOverABf16CacheEqualsAttentionInDouble) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  const std::vector<FlashCase> cases = {
      {"gqa group 4, 64-row tiles", 8, 2, 64, 64, 0, 4, false, {0, 140, 7}, {21, 1, 5}},
      {"gqa group 16, window 6", 32, 2, 32, 32, 6, 16, false, {0, 40, 7}, {21, 1, 5}},
      {"one head per kv head", 4, 4, 16, 16, 0, 16, false, {3, 0}, {70, 2}},
      {"decode only, group 8", 8, 1, 32, 32, 0, 8, false, {90, 3, 17}, {1, 1, 1}},
      {"latent: values in keys", 8, 1, 48, 32, 0, 8, true, {0, 130}, {30, 1}},
      {"one long decode, split-K", 8, 2, 32, 32, 0, 16, false, {700}, {1}},
      {"latent decodes, split-K", 8, 1, 48, 32, 0, 16, true, {300, 90}, {1, 1}},
  };
  // Split-K partials as a device of 132 multiprocessors would get them.
  DeviceBuffer<float> partial(1 << 20);
  const kernels::cuda::FlashWorkspace workspace{partial.data(), 1 << 20, 132};
  Rng rng(131);
  for (const FlashCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::int64_t group = c.heads / c.kv_heads;
    const std::int64_t key_width = c.kv_heads * c.dk;
    const std::int64_t value_width = c.kv_heads * c.dv;
    // Block tables over a shuffled pool.
    std::int64_t blocks_needed = 0;
    for (std::size_t i = 0; i < c.starts.size(); ++i)
      blocks_needed += (c.starts[i] + c.counts[i] + c.block_size - 1) / c.block_size;
    const std::int64_t num_blocks = blocks_needed + 3;
    std::vector<std::int32_t> pool_order(static_cast<std::size_t>(num_blocks));
    std::iota(pool_order.begin(), pool_order.end(), 0);
    std::shuffle(pool_order.begin(), pool_order.end(), rng);
    std::vector<std::vector<std::int32_t>> tables(c.starts.size());
    std::vector<kernels::SequenceSlice> seqs;
    std::int64_t rows = 0;
    std::size_t next = 0;
    for (std::size_t i = 0; i < c.starts.size(); ++i) {
      for (std::int64_t b = 0; b < (c.starts[i] + c.counts[i] + c.block_size - 1) / c.block_size; ++b)
        tables[i].push_back(pool_order[next++]);
      seqs.push_back({rows, c.counts[i], c.starts[i], tables[i]});
      rows += c.counts[i];
    }
    const auto bf16_pool = [&](std::int64_t width) {
      std::vector<std::uint16_t> bits(static_cast<std::size_t>(num_blocks * c.block_size * width));
      const std::vector<float> values = normal_vector(rng, bits.size());
      for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = to_bf16(values[i]);
      return bits;
    };
    const std::vector<std::uint16_t> keys = bf16_pool(key_width);
    const std::vector<std::uint16_t> values = c.values_in_keys ? keys : bf16_pool(value_width);
    const std::int64_t value_stride = c.values_in_keys ? key_width : value_width;
    const std::int64_t value_head = c.values_in_keys ? c.dk : c.dv;
    // Peaked scores (sd 3), so that a later key tile's larger maximum rescales what came before.
    const std::vector<float> q = normal_vector(rng, static_cast<std::size_t>(rows * c.heads * c.dk), 3.0F);
    const float scale = 1.0F / std::sqrt(static_cast<float>(c.dk));

    // The reference: each row over its sequence's positions [lo, pos], in double.
    std::vector<float> ref(static_cast<std::size_t>(rows * c.heads * c.dv));
    for (std::size_t si = 0; si < seqs.size(); ++si) {
      const kernels::SequenceSlice& sl = seqs[si];
      const auto slot = [&](std::int64_t p) {
        return static_cast<std::int64_t>(tables[si][static_cast<std::size_t>(p / c.block_size)]) *
                   c.block_size +
               p % c.block_size;
      };
      for (std::int64_t t = 0; t < sl.num_tokens; ++t) {
        const std::int64_t row = sl.first_row + t;
        const std::int64_t pos = sl.start_pos + t;
        const std::int64_t lo = c.window > 0 ? std::max<std::int64_t>(0, pos - c.window + 1) : 0;
        for (std::int64_t h = 0; h < c.heads; ++h) {
          const std::int64_t kv = h / group;
          std::vector<double> w;
          double top = -INFINITY;
          for (std::int64_t p = lo; p <= pos; ++p) {
            double dot = 0.0;
            for (std::int64_t e = 0; e < c.dk; ++e) {
              dot += static_cast<double>(q[static_cast<std::size_t>((row * c.heads + h) * c.dk + e)]) *
                     from_bf16(keys[static_cast<std::size_t>(slot(p) * key_width + kv * c.dk + e)]);
            }
            w.push_back(dot * scale);
            top = std::max(top, w.back());
          }
          double total = 0.0;
          for (double& x : w) total += (x = std::exp(x - top));
          for (std::int64_t e = 0; e < c.dv; ++e) {
            double acc = 0.0;
            for (std::int64_t p = lo; p <= pos; ++p) {
              acc +=
                  w[static_cast<std::size_t>(p - lo)] *
                  from_bf16(values[static_cast<std::size_t>(slot(p) * value_stride + kv * value_head + e)]);
            }
            ref[static_cast<std::size_t>((row * c.heads + h) * c.dv + e)] = static_cast<float>(acc / total);
          }
        }
      }
    }

    const kernels::cuda::DeviceAttentionArrays arrays(seqs);
    const kernels::cuda::DeviceAttentionBatch& batch = arrays.batch();
    const auto d_keys = upload(keys);
    const auto d_values = upload(values);
    const auto d_q = upload(q);
    auto d_out = poisoned<float>(ref.size());
    const __nv_bfloat16* k_ptr = bf16_ptr(d_keys);
    const kernels::cuda::SharedKvAttention a{d_q.data(),
                                             c.heads,
                                             group,
                                             c.dk,
                                             c.dv,
                                             k_ptr,
                                             c.values_in_keys ? k_ptr : bf16_ptr(d_values),
                                             key_width,
                                             value_stride,
                                             c.dk,
                                             value_head,
                                             c.block_size,
                                             scale,
                                             c.window,
                                             d_out.data()};
    ASSERT_TRUE(kernels::cuda::flash_attention_supports(a));
    const int splits = kernels::cuda::flash_attention_splits(batch, a, workspace);
    if (std::string(c.name).ends_with("split-K")) {
      EXPECT_GT(splits, 1);
    }
    // Each batch whole, and split where the device would be idle otherwise.
    for (const bool split : {false, true}) {
      SCOPED_TRACE(split ? "with the workspace: " + std::to_string(splits) + " splits" : "whole");
      kernels::cuda::flash_attention(batch, a, split ? workspace : kernels::cuda::FlashWorkspace{}, nullptr);
      EXPECT_LT(relative_error(download(d_out, ref.size()), ref), 2e-3);
      CAPSERVE_CUDA_CHECK(cudaMemset(d_out.data(), 0xFF, d_out.bytes()));
    }
  }
}

TEST(CudaKernels, FlashAttentionRefusesShapesItDoesNotTake) {
  kernels::cuda::SharedKvAttention a;
  a.heads = 8;
  a.group = 4;
  a.dk = 72;  // not a multiple of 16
  a.dv = 64;
  a.key_stride = a.value_stride = 144;
  a.block_size = 16;
  EXPECT_FALSE(kernels::cuda::flash_attention_supports(a));
  EXPECT_THROW(kernels::cuda::flash_attention({}, a, {}, nullptr), std::invalid_argument);
  a.dk = 64;
  EXPECT_TRUE(kernels::cuda::flash_attention_supports(a));
  a.dv = 528;  // above 512
  EXPECT_FALSE(kernels::cuda::flash_attention_supports(a));
}

TEST(CudaKernels, SamplingFollowsTheCpuSampler) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(79);
  const std::int64_t vocab = 5000;
  const std::int64_t rows = 64;
  // Integer logits: ties everywhere, so greedy must take the first maximal id.
  std::vector<float> logits(static_cast<std::size_t>(rows * vocab));
  for (float& l : logits) l = static_cast<float>(uniform(rng, 0, 20));
  std::vector<kernels::SampleControls> controls(static_cast<std::size_t>(rows));
  for (std::size_t r = 0; r < controls.size(); ++r) {
    // Greedy, or sampling so narrow that only the best token survives (top-k 1, or a tiny top-p).
    controls[r].temperature = r % 3 == 0 ? 0.0F : 0.8F;
    controls[r].top_k = r % 3 == 1 ? 1 : 0;
    controls[r].top_p = r % 3 == 2 ? 1e-6F : 1.0F;
    controls[r].seed = r;
  }
  const auto d_logits = upload(logits);
  const auto d_controls = upload(controls);
  auto d_tokens = poisoned<std::int32_t>(static_cast<std::size_t>(rows));
  kernels::cuda::sample(d_logits.data(), rows, vocab, d_controls.data(), d_tokens.data(), nullptr);
  const std::vector<std::int32_t> tokens = download(d_tokens, static_cast<std::size_t>(rows));
  kernels::cpu::CpuBackend cpu(1);
  for (std::int64_t r = 0; r < rows; ++r) {
    const kernels::SampleControls greedy;
    std::int32_t expected = -1;
    cpu.sample(kernels::Tensor::host(std::span(logits).subspan(static_cast<std::size_t>(r * vocab),
                                                               static_cast<std::size_t>(vocab)),
                                     {1, vocab}),
               std::span(&greedy, 1), kernels::Tensor::host(std::span(&expected, 1), {1}));
    EXPECT_EQ(tokens[static_cast<std::size_t>(r)], expected) << "row " << r;
  }
}

// Distribution: temperature 1, top-k 4 and top-p 0.9 over a small vocabulary; many draws against the CPU's
// (a test of its own: 20000 blocks are slow under the emulation's shuffled order and under racecheck).
TEST(CudaKernels, SampledFrequenciesMatchTheCpuSampler) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  kernels::cpu::CpuBackend cpu(1);
  const std::vector<float> small = {2.0F, 1.0F, 0.5F, 3.0F, -1.0F, 2.0F, 0.0F, 1.5F};
  const std::int64_t draws = 20000;
  std::vector<float> many;
  for (std::int64_t i = 0; i < draws; ++i) many.insert(many.end(), small.begin(), small.end());
  std::vector<kernels::SampleControls> sampling(static_cast<std::size_t>(draws));
  for (std::size_t i = 0; i < sampling.size(); ++i) sampling[i] = {1.0F, 4, 0.9F, 7, i};
  const auto d_many = upload(many);
  const auto d_sampling = upload(sampling);
  auto d_drawn = poisoned<std::int32_t>(static_cast<std::size_t>(draws));
  kernels::cuda::sample(d_many.data(), draws, static_cast<std::int64_t>(small.size()), d_sampling.data(),
                        d_drawn.data(), nullptr);
  std::vector<double> gpu_freq(small.size(), 0.0);
  for (const std::int32_t t : download(d_drawn, static_cast<std::size_t>(draws))) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, static_cast<std::int32_t>(small.size()));
    gpu_freq[static_cast<std::size_t>(t)] += 1.0 / static_cast<double>(draws);
  }
  std::vector<kernels::SampleControls> cpu_sampling(static_cast<std::size_t>(draws));
  for (std::size_t i = 0; i < cpu_sampling.size(); ++i) cpu_sampling[i] = {1.0F, 4, 0.9F, 3, i};
  std::vector<std::int32_t> cpu_drawn(static_cast<std::size_t>(draws));
  cpu.sample(kernels::Tensor::host(std::span(many), {draws, static_cast<std::int64_t>(small.size())}),
             cpu_sampling, kernels::Tensor::host(std::span(cpu_drawn), {draws}));
  std::vector<double> cpu_freq(small.size(), 0.0);
  for (const std::int32_t t : cpu_drawn)
    cpu_freq[static_cast<std::size_t>(t)] += 1.0 / static_cast<double>(draws);
  for (std::size_t t = 0; t < small.size(); ++t) EXPECT_NEAR(gpu_freq[t], cpu_freq[t], 0.02) << "token " << t;
}

TEST(CudaKernels, NanLogitsAreNeverSampled) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(83);
  const std::int64_t vocab = 700;
  const std::int64_t rows = 24;
  std::vector<float> logits = normal_vector(rng, static_cast<std::size_t>(rows * vocab));
  std::vector<std::int32_t> want(static_cast<std::size_t>(rows));
  std::vector<kernels::SampleControls> controls(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = logits.data() + r * vocab;
    // NaN at id 0, at the would-be maximum, and at random places.
    const auto top = std::max_element(row, row + vocab) - row;
    row[0] = NAN;
    row[top] = NAN;
    for (int i = 0; i < 50; ++i) row[uniform(rng, 0, vocab - 1)] = NAN;
    std::int64_t best = -1;
    for (std::int64_t i = 0; i < vocab; ++i) {
      if (!std::isnan(row[i]) && (best < 0 || row[i] > row[best])) best = i;
    }
    want[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(best);
    // Greedy, then sampling with and without top-k / top-p.
    auto& c = controls[static_cast<std::size_t>(r)];
    c = {r % 4 == 0 ? 0.0F : 1.0F, r % 4 == 2 ? 5 : 0, r % 4 == 3 ? 0.9F : 1.0F, 5,
         static_cast<std::uint64_t>(r)};
  }
  const auto d_logits = upload(logits);
  const auto d_controls = upload(controls);
  auto d_tokens = poisoned<std::int32_t>(static_cast<std::size_t>(rows));
  kernels::cuda::sample(d_logits.data(), rows, vocab, d_controls.data(), d_tokens.data(), nullptr);
  const std::vector<std::int32_t> tokens = download(d_tokens, static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t t = tokens[static_cast<std::size_t>(r)];
    ASSERT_GE(t, 0) << "row " << r;
    ASSERT_LT(t, vocab) << "row " << r;
    EXPECT_FALSE(std::isnan(logits[static_cast<std::size_t>(r * vocab + t)]))
        << "row " << r << " drew NaN id " << t;
    if (r % 4 == 0) {
      EXPECT_EQ(t, want[static_cast<std::size_t>(r)]) << "row " << r;
    }
  }
}

// The token log-probability kernel against the CPU backend's: rows of 24 x 700 logits with NaNs, ties and
// -inf, every rank of the smaller ones (top_k = vocab: NaN last), tokens inside and outside the vocabulary.
TEST(CudaKernels, TokenLogprobsEqualTheCpuBackend) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  Rng rng(89);
  kernels::cpu::CpuBackend cpu(1);
  for (const auto& [rows, vocab, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{24, 700, 7},
                                       std::tuple<std::int64_t, std::int64_t, std::int64_t>{3, 40, 40}}) {
    std::vector<float> logits = normal_vector(rng, static_cast<std::size_t>(rows * vocab), 3.0F);
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = logits.data() + r * vocab;
      row[uniform(rng, 0, vocab - 1)] = 9.0F;  // a tie for the lead
      row[uniform(rng, 0, vocab - 1)] = 9.0F;
      row[uniform(rng, 0, vocab - 1)] = -INFINITY;
      if (r % 3 == 1) row[uniform(rng, 0, vocab - 1)] = NAN;
      tokens[static_cast<std::size_t>(r)] =
          static_cast<std::int32_t>(r % 5 == 4 ? vocab : uniform(rng, 0, vocab - 1));
    }
    std::vector<float> want_values(static_cast<std::size_t>(rows * (1 + k)));
    std::vector<std::int32_t> want_ids(static_cast<std::size_t>(rows * k));
    cpu.token_logprobs(kernels::Tensor::host(std::span(logits), {rows, vocab}),
                       kernels::Tensor::host(std::span(tokens), {rows}),
                       kernels::Tensor::host(std::span(want_values), {rows, 1 + k}),
                       kernels::Tensor::host(std::span(want_ids), {rows, k}));
    const auto d_logits = upload(logits);
    const auto d_tokens = upload(tokens);
    auto d_values = poisoned<float>(want_values.size());
    auto d_ids = poisoned<std::int32_t>(want_ids.size());
    kernels::cuda::token_logprobs(d_logits.data(), rows, vocab, d_tokens.data(), k, d_values.data(),
                                  d_ids.data(), nullptr);
    EXPECT_EQ(download(d_ids, want_ids.size()), want_ids) << vocab;
    const std::vector<float> values = download(d_values, want_values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(want_values[i])) {
        EXPECT_TRUE(std::isnan(values[i])) << vocab << ": value " << i;
      } else if (std::isinf(want_values[i])) {
        EXPECT_EQ(values[i], want_values[i]) << vocab << ": value " << i;  // the -inf logit
      } else {
        EXPECT_NEAR(values[i], want_values[i], 1e-5) << vocab << ": value " << i;
      }
    }
  }
}

// The residual-stream operations against the CPU backend's: embedding from tables in every weight dtype,
// residual add, clamp and row gather bit for bit; the sigmoid-gated add within the device's expf.
TEST(CudaKernels, ResidualStreamOperationsEqualTheCpuBackend) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  using kernels::Tensor;
  Rng rng(83);
  kernels::cpu::CpuBackend cpu(1);
  const std::int64_t rows = 37;
  const std::int64_t cols = 300;
  const std::int64_t vocab = 50;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
  for (std::int32_t& id : ids) id = static_cast<std::int32_t>(uniform(rng, 0, vocab - 1));
  const auto d_ids = upload(ids);
  const std::vector<float> values = normal_vector(rng, static_cast<std::size_t>(vocab * cols));
  std::vector<std::uint16_t> bf16(values.size());
  std::vector<std::uint16_t> f16(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    bf16[i] = to_bf16(values[i]);
    f16[i] = std::bit_cast<std::uint16_t>(__float2half_rn(values[i]));
  }
  const auto table_bytes = [](const auto& v) { return reinterpret_cast<const std::byte*>(v.data()); };
  const std::vector<std::pair<kernels::DType, const std::byte*>> tables = {
      {kernels::DType::f32, table_bytes(values)},
      {kernels::DType::bf16, table_bytes(bf16)},
      {kernels::DType::f16, table_bytes(f16)}};
  for (const auto& [dtype, host_table] : tables) {
    const std::size_t bytes = static_cast<std::size_t>(vocab * cols) * kernels::dtype_size(dtype);
    DeviceBuffer<std::byte> d_table(bytes);
    CAPSERVE_CUDA_CHECK(cudaMemcpy(d_table.data(), host_table, bytes, cudaMemcpyHostToDevice));
    auto d_out = poisoned<float>(static_cast<std::size_t>(rows * cols));
    kernels::cuda::embedding(d_ids.data(), rows, d_table.data(), dtype, vocab, cols, d_out.data(), nullptr);
    std::vector<float> ref(static_cast<std::size_t>(rows * cols));
    cpu.embedding(Tensor::host(std::span(ids), {rows}),
                  kernels::weight_tensor({dtype, host_table, vocab, cols}),
                  Tensor::host(std::span(ref), {rows, cols}));
    EXPECT_EQ(download(d_out, ref.size()), ref) << kernels::dtype_name(dtype);
  }

  const std::vector<float> x = normal_vector(rng, static_cast<std::size_t>(rows * cols), 4.0F);
  const std::vector<float> y = normal_vector(rng, x.size());
  const std::vector<float> gate = normal_vector(rng, static_cast<std::size_t>(rows), 2.0F);
  const auto x_t = [&](std::vector<float>& v) { return Tensor::host(std::span(v), {rows, cols}); };

  auto d_x = upload(x);
  const auto d_y = upload(y);
  std::vector<float> want = x;
  kernels::cuda::add(d_x.data(), d_y.data(), rows * cols, nullptr);
  std::vector<float> y_copy = y;
  cpu.add(x_t(want), x_t(y_copy));
  EXPECT_EQ(download(d_x, x.size()), want);

  kernels::cuda::clamp(d_x.data(), rows * cols, 1.5F, nullptr);
  cpu.clamp(x_t(want), 1.5F);
  EXPECT_EQ(download(d_x, x.size()), want);

  const auto d_gate = upload(gate);
  kernels::cuda::add_sigmoid_gated(d_x.data(), d_y.data(), d_gate.data(), rows, cols, nullptr);
  std::vector<float> gate_copy = gate;
  cpu.add_sigmoid_gated(x_t(want), x_t(y_copy), Tensor::host(std::span(gate_copy), {rows}));
  EXPECT_LT(relative_error(download(d_x, x.size()), want), 1e-6);

  std::vector<std::int64_t> picks = {rows - 1, 0, 5, 5, 17};
  const auto d_picks = upload(picks);
  auto d_gathered = poisoned<float>(picks.size() * static_cast<std::size_t>(cols));
  const auto d_src = upload(x);
  kernels::cuda::gather_rows(d_src.data(), d_picks.data(), static_cast<std::int64_t>(picks.size()), cols,
                             d_gathered.data(), nullptr);
  std::vector<float> x_copy = x;
  std::vector<float> gathered(picks.size() * static_cast<std::size_t>(cols));
  cpu.gather_rows(x_t(x_copy), picks,
                  Tensor::host(std::span(gathered), {static_cast<std::int64_t>(picks.size()), cols}));
  EXPECT_EQ(download(d_gathered, gathered.size()), gathered);
}

// The dense layer against the CPU backend's for every weight dtype, with and without a bias: f32 weights to
// fp32 rounding, bf16 and f16 weights within the rounding of x to their type.
TEST(CudaKernels, LinearEqualsTheCpuBackendForEveryWeightType) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  using kernels::DType;
  using kernels::Tensor;
  Rng rng(89);
  kernels::cpu::CpuBackend cpu(1);
  kernels::cuda::Linear linear;
  const std::int64_t k = 96;
  const std::int64_t n = 70;
  const std::vector<float> w = normal_vector(rng, static_cast<std::size_t>(n * k), 0.1F);
  const std::vector<float> b = normal_vector(rng, static_cast<std::size_t>(n));
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    std::vector<std::byte> w_bytes(w.size() * kernels::dtype_size(dtype));
    std::vector<std::byte> b_bytes(b.size() * kernels::dtype_size(dtype));
    const auto store = [dtype](const std::vector<float>& from, std::vector<std::byte>& to) {
      for (std::size_t i = 0; i < from.size(); ++i) {
        if (dtype == DType::f32) {
          std::memcpy(to.data() + 4 * i, &from[i], 4);
        } else {
          const std::uint16_t h = dtype == DType::bf16
                                      ? to_bf16(from[i])
                                      : std::bit_cast<std::uint16_t>(__float2half_rn(from[i]));
          std::memcpy(to.data() + 2 * i, &h, 2);
        }
      }
    };
    store(w, w_bytes);
    store(b, b_bytes);
    const auto d_w = upload(w_bytes);
    const auto d_b = upload(b_bytes);
    for (const std::int64_t m : {1, 5, 40}) {
      for (const bool with_bias : {false, true}) {
        const std::vector<float> x = normal_vector(rng, static_cast<std::size_t>(m * k));
        const auto d_x = upload(x);
        auto d_y = poisoned<float>(static_cast<std::size_t>(m * n));
        DeviceBuffer<std::byte> workspace(static_cast<std::size_t>(
            std::max<std::int64_t>(1, kernels::cuda::Linear::workspace_bytes(m, k, dtype))));
        linear.run(d_x.data(), m, k, d_w.data(), dtype, {}, n, with_bias ? d_b.data() : nullptr, dtype,
                   d_y.data(), workspace.data(), nullptr);
        std::vector<float> x_copy = x;
        std::vector<float> ref(static_cast<std::size_t>(m * n));
        cpu.linear(Tensor::host(std::span(x_copy), {m, k}),
                   kernels::weight_tensor({dtype, w_bytes.data(), n, k}),
                   with_bias ? kernels::weight_tensor({dtype, b_bytes.data(), 1, n}) : Tensor{},
                   Tensor::host(std::span(ref), {m, n}));
        EXPECT_LT(relative_error(download(d_y, ref.size()), ref), dtype == DType::f32 ? 1e-6 : 1e-2)
            << kernels::dtype_name(dtype) << " m=" << m << " bias=" << with_bias;
      }
    }
  }
}

// Multi-head latent attention on the device (always the absorbed form) against the CPU backend's (its
// cheaper form per sequence: expanded for the prefill chunk, absorbed for the decode token), for every kv_b
// dtype and both cache dtypes; the latent stores equal bit for bit. A bf16 cache rounds each value once when
// stored, so the CPU reference is given the rounded values. Two sequences over scattered blocks, one a
// prefill chunk behind cached context.
TEST(CudaKernels, LatentAttentionEqualsTheCpuBackend) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  using kernels::DType;
  using kernels::Tensor;
  Rng rng(97);
  kernels::cpu::CpuBackend cpu(1);
  const std::int64_t heads = 3, dn = 16, dr = 8, dv = 12, r = 40, block = 4, num_blocks = 12;
  const std::int64_t qk = dn + dr;
  const std::vector<std::int32_t> table0 = {3, 0, 5, 9};
  const std::vector<std::int32_t> table1 = {1, 6, 2};
  const std::int64_t context[2] = {13, 10};
  // Sequence 0's last 9 positions and sequence 1's last one are new this step.
  const std::vector<kernels::SequenceSlice> cached = {{0, context[0] - 9, 0, table0},
                                                      {context[0] - 9, context[1] - 1, 0, table1}};
  const std::vector<kernels::SequenceSlice> seqs = {{0, 9, context[0] - 9, table0},
                                                    {9, 1, context[1] - 1, table1}};
  const std::int64_t cached_rows = context[0] - 9 + context[1] - 1;
  const std::int64_t rows = 10;
  const std::vector<float> old_latent = normal_vector(rng, static_cast<std::size_t>(cached_rows * r));
  const std::vector<float> old_rope = normal_vector(rng, static_cast<std::size_t>(cached_rows * dr));
  const std::vector<float> latent = normal_vector(rng, static_cast<std::size_t>(rows * r));
  const std::vector<float> rope_key = normal_vector(rng, static_cast<std::size_t>(rows * dr));
  const std::vector<float> q = normal_vector(rng, static_cast<std::size_t>(rows * heads * qk));
  const std::vector<float> kv_b = normal_vector(rng, static_cast<std::size_t>(heads * (dn + dv) * r), 0.2F);
  const kernels::cuda::AttentionBatchArrays arrays = kernels::cuda::attention_batch_arrays(seqs);
  const auto d_pos = upload(arrays.row_pos);
  const auto d_seq = upload(arrays.row_seq);
  const auto d_tables = upload(arrays.block_tables);
  const kernels::cuda::DeviceAttentionBatch batch{rows, d_pos.data(), d_seq.data(), d_tables.data(),
                                                  arrays.max_blocks};
  const auto d_q = upload(q);
  const kernels::LatentAttentionParams params{heads, dn, dr, dv, 0.3F, kernels::LatentForm::cheaper};

  for (const DType cache_dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE("cache " + std::string(kernels::dtype_name(cache_dtype)));
    const bool bf16 = cache_dtype == DType::bf16;
    const auto stored = [&](std::vector<float> v) {
      if (bf16)
        for (float& x : v) x = from_bf16(to_bf16(x));
      return v;
    };
    // Both caches filled the same way: the cached context, then this step's rows.
    const std::size_t pool_size = static_cast<std::size_t>(num_blocks * block * (r + dr));
    std::vector<float> pool(pool_size, 0.0F);
    const kernels::PagedLatentLayer cpu_cache{Tensor::host(std::span(pool), {num_blocks, block, r + dr}),
                                              block, r, dr};
    DeviceBuffer<std::byte> d_pool(pool_size * kernels::dtype_size(cache_dtype));
    CAPSERVE_CUDA_CHECK(cudaMemset(d_pool.data(), 0, d_pool.bytes()));
    const kernels::cuda::DeviceLatentLayer d_cache{d_pool.data(), cache_dtype, block, r, dr};
    const auto store_both = [&](std::span<const kernels::SequenceSlice> slices, const std::vector<float>& lat,
                                const std::vector<float>& rk, std::int64_t n) {
      std::vector<float> lat_copy = stored(lat);
      std::vector<float> rk_copy = stored(rk);
      cpu.latent_store(slices, Tensor::host(std::span(lat_copy), {n, r}),
                       Tensor::host(std::span(rk_copy), {n, dr}), cpu_cache);
      const kernels::cuda::AttentionBatchArrays a = kernels::cuda::attention_batch_arrays(slices);
      const auto pos = upload(a.row_pos);
      const auto seq = upload(a.row_seq);
      const auto tables = upload(a.block_tables);
      const auto d_lat = upload(lat);
      const auto d_rk = upload(rk);
      kernels::cuda::latent_store({n, pos.data(), seq.data(), tables.data(), a.max_blocks}, d_lat.data(),
                                  d_rk.data(), d_cache, nullptr);
      CAPSERVE_CUDA_CHECK(cudaDeviceSynchronize());
    };
    store_both(cached, old_latent, old_rope, cached_rows);
    store_both(seqs, latent, rope_key, rows);
    const std::vector<std::byte> device_pool = download(d_pool, d_pool.bytes());
    std::vector<float> widened(pool_size);
    for (std::size_t i = 0; i < pool_size; ++i) {
      if (bf16) {
        std::uint16_t h = 0;
        std::memcpy(&h, device_pool.data() + 2 * i, 2);
        widened[i] = from_bf16(h);
      } else {
        std::memcpy(&widened[i], device_pool.data() + 4 * i, 4);
      }
    }
    EXPECT_EQ(widened, pool);

    for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      std::vector<std::byte> w(kv_b.size() * kernels::dtype_size(dtype));
      for (std::size_t i = 0; i < kv_b.size(); ++i) {
        if (dtype == DType::f32) {
          std::memcpy(w.data() + 4 * i, &kv_b[i], 4);
        } else {
          const std::uint16_t h = dtype == DType::bf16
                                      ? to_bf16(kv_b[i])
                                      : std::bit_cast<std::uint16_t>(__float2half_rn(kv_b[i]));
          std::memcpy(w.data() + 2 * i, &h, 2);
        }
      }
      const auto d_w = upload(w);
      auto d_out = poisoned<float>(static_cast<std::size_t>(rows * heads * dv));
      // The three stages with the fp32 core (the tensor-core one has its own test).
      kernels::cuda::LatentAttention latent;
      DeviceBuffer<std::byte> workspace(
          static_cast<std::size_t>(kernels::cuda::LatentAttention::workspace_bytes(rows, params, r)));
      const auto core = [&](const float* q_abs, float* o_lat) {
        kernels::cuda::latent_attention_core(batch, q_abs, d_cache, heads, params.scale, o_lat, nullptr);
      };
      latent.run(rows, d_q.data(), r, d_w.data(), dtype, params, kernels::cuda::LatentCore(core),
                 d_out.data(), workspace.data(), nullptr);
      std::vector<float> q_copy = q;
      std::vector<float> ref(static_cast<std::size_t>(rows * heads * dv));
      cpu.latent_attention(seqs, Tensor::host(std::span(q_copy), {rows, heads * qk}), cpu_cache,
                           kernels::weight_tensor({dtype, w.data(), heads * (dn + dv), r}), params,
                           Tensor::host(std::span(ref), {rows, heads * dv}));
      // 16-bit weights meet the activations as two 16-bit halves: near fp32 (seen: 2e-7 f32 and f16, 3.4e-6
      // bf16).
      EXPECT_LT(relative_error(download(d_out, ref.size()), ref), 1e-5) << kernels::dtype_name(dtype);
    }
  }
}

}  // namespace
}  // namespace capserve
