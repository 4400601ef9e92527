// The whole model on CudaBackend across ranks, one GPU per rank, rows exchanged over NCCL (the cuda-emu label
// runs it under mpirun on the emulation and its NCCL stand-in): each rank prefills its own prompt, and
//  - with gamma = inf the logits equal a single-process CUDA model's on the same prompt;
//  - the same against the CPU backend over MPI (the router's choices too), and with EPLB replicas (each
//    copy's load too);
//  - on the same router probabilities, the capacity stage's decisions under every option equal the CPU
//    backend's bit for bit (global scope's reductions going over NCCL).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "tests/gpu/communicators/cuda_test_device.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/mpi/mpi_gtest_main.h"
#include "tests/support/capacity_layer.h"
#include "tests/support/replication_stats.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve {
namespace {

using parallel::CapacityConfig;
using parallel::CapacityGranularity;
using parallel::CapacityPolicy;
using parallel::CapacityScope;

// As test_cuda_model.cpp: f32 weights are held to 1e-4, bf16 weights to bf16 rounding.
double tolerance(const runtime::Model& model) {
  return model.weights().lm_head.dtype() == kernels::DType::f32 ? 1e-4 : 1e-2;
}

struct Outcome {
  std::vector<float> logits;
  parallel::MoeStepStats stats;
};

// One prefill of `prompt` as this rank's sequence, its last-position logits and the step's statistics.
Outcome prefill(runtime::Engine& engine, const std::vector<std::int32_t>& prompt) {
  const runtime::Engine::Work work{7, prompt, false};
  EXPECT_TRUE(engine.step(std::span(&work, 1)).ok());
  Outcome o;
  o.logits.assign(engine.logits().begin(), engine.logits().end());
  o.stats = engine.last_moe_stats();
  engine.release(7);
  return o;
}

std::vector<CapacityConfig> capacity_options() {
  std::vector<CapacityConfig> out;
  for (const CapacityPolicy policy :
       {CapacityPolicy::drop, CapacityPolicy::reroute, CapacityPolicy::expanded}) {
    for (const CapacityScope scope : {CapacityScope::local, CapacityScope::global}) {
      for (const CapacityGranularity granularity :
           {CapacityGranularity::expert, CapacityGranularity::device}) {
        CapacityConfig c;
        c.gamma = {0.75};
        c.policy = policy;
        c.scope = scope;
        c.granularity = granularity;
        out.push_back(c);
      }
    }
  }
  return out;
}

class CudaModelMpi : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    CAPSERVE_REQUIRE_GPU_PER_RANK();
    dir_ = testing::fixture_models_dir() / GetParam();
    const nlohmann::json ref = testing::fixture_reference(GetParam());
    const auto& prompts = ref["prompts"];
    // Different lengths on different ranks: the ragged split the capacity scheduler's global scope sees.
    prompt_ = prompts[static_cast<std::size_t>(test::mpi_world().rank()) % prompts.size()]["input_ids"]
                  .get<std::vector<std::int32_t>>();
    nccl_.emplace(test::mpi_world());
    gpu_.emplace(nccl_->device().index);
  }

  // The model under `options` on both backends over MPI, each rank prefilling its prompt: the same logits,
  // and the same routing and loads (per expert, per copy, per rank).
  void expect_as_on_the_cpu_backend(const runtime::ParallelOptions& options) {
    const auto cuda_model = runtime::Model::load(dir_, *gpu_, *nccl_, control_, options);
    const auto cpu_model = runtime::Model::load(dir_, cpu_, cpu_comm_, options);
    EXPECT_EQ(cuda_model->placement().num_slots(), cpu_model->placement().num_slots());
    runtime::Engine cuda_engine(*cuda_model, {});
    runtime::Engine cpu_engine(*cpu_model, {});
    const Outcome got = prefill(cuda_engine, prompt_);
    const Outcome want = prefill(cpu_engine, prompt_);
    EXPECT_LE(testing::relative_max_diff(got.logits, want.logits), tolerance(*cuda_model));
    ASSERT_EQ(got.stats.layers.size(), want.stats.layers.size());
    for (std::size_t l = 0; l < got.stats.layers.size(); ++l) {
      const parallel::MoeLayerStats& g = got.stats.layers[l];
      const parallel::MoeLayerStats& w = want.stats.layers[l];
      EXPECT_EQ(g.routed_load, w.routed_load) << "layer " << l;
      EXPECT_EQ(g.routed_slot_load, w.routed_slot_load) << "layer " << l;
      EXPECT_EQ(g.slot_load, w.slot_load) << "layer " << l;
      EXPECT_EQ(g.rank_load, w.rank_load) << "layer " << l;
    }
  }

  std::filesystem::path dir_;
  std::vector<std::int32_t> prompt_;
  std::optional<parallel::NcclCommunicator> nccl_;
  std::optional<kernels::cuda::CudaBackend> gpu_;
  parallel::MpiCommunicator control_;
  parallel::MpiCommunicator cpu_comm_;
  kernels::cpu::CpuBackend cpu_{1};
};

TEST_P(CudaModelMpi, GammaInfinityEqualsOneProcess) {
  const auto single = runtime::Model::load(dir_, *gpu_);
  runtime::Engine single_engine(*single, {});
  const Outcome want = prefill(single_engine, prompt_);
  const auto model = runtime::Model::load(dir_, *gpu_, *nccl_, control_, {});
  runtime::Engine engine(*model, {});
  const Outcome got = prefill(engine, prompt_);
  EXPECT_LE(testing::relative_max_diff(got.logits, want.logits), tolerance(*model))
      << "rank " << test::mpi_world().rank() << " of " << test::mpi_world().size();
  for (const parallel::MoeLayerStats& s : got.stats.layers) {
    EXPECT_EQ(s.dropped, 0);
    EXPECT_EQ(s.rerouted, 0);
  }
}

TEST_P(CudaModelMpi, GammaInfinityIsTheExactModelOnTheCpuBackendToo) {
  expect_as_on_the_cpu_backend({});
}

// EPLB replication (--redundant-experts) on the device: each entry's copy chosen (moe::AssignCopies) and the
// rows exchanged as on the CPU backend, so the logits and every copy's load agree.
TEST_P(CudaModelMpi, ReplicatedExpertsAsOnTheCpuBackend) {
  const int ranks = test::mpi_world().size();
  if (ranks < 2) GTEST_SKIP() << "replicas need at least two ranks";
  const auto reference = runtime::Model::load(dir_, cpu_);
  runtime::ParallelOptions options;
  options.placement = testing::write_hot_expert_stats(
                          std::filesystem::temp_directory_path() /
                              ("capserve_cuda_replication_" + std::to_string(::getpid()) + ".json"),
                          reference->moe_layers(), reference->config().num_experts)
                          .string();
  options.redundant_experts = ranks;
  expect_as_on_the_cpu_backend(options);
  std::filesystem::remove(options.placement);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaModelMpi, ::testing::ValuesIn(testing::fixture_model_names()),
                         [](const auto& info) { return info.param; });

// The capacity stage on the same router probabilities on both backends, each rank its own tokens: CudaBackend
// with the NCCL data plane against CpuBackend over MPI, for every option; the kept experts, gate weights and
// slot states must be equal bit for bit. Logits on a grid make many exact ties, which the selection keys must
// break alike everywhere.
TEST(CudaCapacityMpi, EveryOptionDecidesAsTheCpuBackendOnTheSameProbabilities) {
  CAPSERVE_REQUIRE_GPU_PER_RANK();
  parallel::NcclCommunicator nccl(test::mpi_world());
  kernels::cuda::CudaBackend gpu(nccl.device().index);
  parallel::MpiCommunicator control;
  parallel::MpiCommunicator cpu_comm;
  kernels::cpu::CpuBackend cpu(1);
  const int rank = test::mpi_world().rank();
  const int ranks = test::mpi_world().size();
  const std::int64_t E = 16, k = 4;
  const std::int64_t T = 20 + 7 * rank;  // ragged: global scope sees different token counts per rank
  std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(rank));
  std::vector<float> logits(static_cast<std::size_t>(T * E));
  for (float& l : logits) l = static_cast<float>(rng() % 4) * 0.5F;
  const testing::HostRouting routing = testing::route_softmax(logits, T, E, k, true);
  const parallel::ExpertPlacement placement = parallel::ExpertPlacement::contiguous(1, E, ranks);
  const parallel::PlacementTables gpu_tables(gpu, placement, rank);
  const parallel::PlacementTables cpu_tables(cpu, placement, rank);
  std::int64_t decided = 0;  // slots dropped or rerouted over every option: the check must bite
  for (const CapacityConfig& capacity : capacity_options()) {
    const std::string what = parallel::describe(capacity);
    // Each backend's copy of the same routing, then the stage in place.
    const auto run = [&](kernels::Backend& backend, parallel::Communicator& data,
                         const parallel::LayerTables& tables, std::vector<std::int32_t>& experts,
                         std::vector<float>& weights, std::vector<std::uint8_t>& status) {
      std::vector<kernels::Buffer> buffers(5);
      const auto put = [&](kernels::Buffer& slot, const auto& host, kernels::DType dtype,
                           std::initializer_list<std::int64_t> shape) {
        const kernels::Tensor t = backend.scratch(slot, dtype, shape);
        backend.from_host(std::as_bytes(std::span(host)), t);
        return t;
      };
      experts = routing.experts;
      weights = routing.weights;
      status.assign(experts.size(), 9);
      std::vector<std::int64_t> totals(2, -1);
      const parallel::LayerRouting r{put(buffers[0], routing.probs, kernels::DType::f32, {T, E}),
                                     put(buffers[1], experts, kernels::DType::i32, {T, k}),
                                     put(buffers[2], weights, kernels::DType::f32, {T, k}),
                                     put(buffers[3], status, kernels::DType::u8, {T, k}),
                                     {},
                                     put(buffers[4], totals, kernels::DType::i64, {2}),
                                     true,
                                     1.0F};
      parallel::CapacityStage stage(capacity, data, control);
      stage.begin_step(T);
      stage.apply(backend, 0, tables, r);
      backend.to_host(r.experts, std::as_writable_bytes(std::span(experts)), kernels::HostSync::logits);
      backend.to_host(r.weights, std::as_writable_bytes(std::span(weights)), kernels::HostSync::logits);
      backend.to_host(r.status, std::as_writable_bytes(std::span(status)), kernels::HostSync::logits);
    };
    std::vector<std::int32_t> gpu_experts, cpu_experts;
    std::vector<float> gpu_weights, cpu_weights;
    std::vector<std::uint8_t> gpu_status, cpu_status;
    run(gpu, nccl, gpu_tables.layer(0), gpu_experts, gpu_weights, gpu_status);
    run(cpu, cpu_comm, cpu_tables.layer(0), cpu_experts, cpu_weights, cpu_status);
    EXPECT_EQ(gpu_experts, cpu_experts) << what;
    EXPECT_EQ(gpu_status, cpu_status) << what;
    EXPECT_EQ(gpu_weights, cpu_weights) << what;
    for (const std::uint8_t st : cpu_status) decided += st == 0 ? 0 : 1;
  }
  EXPECT_GT(decided, 0) << "gamma 0.75 changed no assignment";
}

}  // namespace
}  // namespace capserve
