// CudaBackend's promises about the host, counted by the emulation: within a step the host waits only in
// to_host (each call one synchronisation), copies nothing to the device from pageable memory (the host would
// wait for such a copy), and a warm step allocates no device memory (grow-only scratch). For a whole model's
// decode step that is runtime/README.md's list: without a capacity factor two per MoE layer and one for the
// sampled tokens; with one, only the sampled tokens, the step running inside a graph capture. After an
// engine's start-up reservation (EngineOptions::max_step_tokens) no step up to that size allocates.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_emu.h"
#include "kernels/cuda/cuda_backend.h"
#include "parallel/moe_stats.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "tests/unit/runtime/fixture_models.h"

// Host allocations of this thread while counting, the emulation's own left out (operator new replaced for
// this test program): what a warm step must not make.
namespace {
thread_local bool counting_news = false;
thread_local std::int64_t news = 0;
}  // namespace

// The replacement pair allocates with malloc and frees with free; GCC, seeing both inlined, takes the free
// for a mismatch with new.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t bytes) {
  if (counting_news && !capserve::cuda_emu::inside_emulation()) ++news;
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t /*bytes*/) noexcept {
  std::free(p);
}

namespace capserve::kernels {
namespace {

// Counts the host allocations of this thread while it lives.
class CountNews {
 public:
  CountNews() {
    news = 0;
    counting_news = true;
  }
  ~CountNews() { counting_news = false; }
  CountNews(const CountNews&) = delete;
  CountNews& operator=(const CountNews&) = delete;
  [[nodiscard]] std::int64_t count() const { return news; }
};

TEST(CudaBackendSyncs, AWarmStepWaitsOnlyInToHostAndAllocatesNothing) {
  cuda::CudaBackend backend(0);
  const std::int64_t rows = 6, hidden = 32, vocab = 50, block = 4;
  std::vector<float> table(static_cast<std::size_t>(vocab * hidden), 0.01F);
  std::vector<float> norm(static_cast<std::size_t>(hidden), 1.0F);
  std::vector<Buffer> weights(3);
  const Tensor embed = backend.upload(
      {DType::f32, reinterpret_cast<const std::byte*>(table.data()), vocab, hidden}, weights[0]);
  const Tensor norm_w =
      backend.upload({DType::f32, reinterpret_cast<const std::byte*>(norm.data()), 1, hidden}, weights[1]);
  Buffer kv_k = backend.allocate(static_cast<std::size_t>(4 * block * hidden) * sizeof(float));
  Buffer kv_v = backend.allocate(kv_k.bytes());
  const PagedKvLayer cache{kv_k.view(DType::f32, {4, block, 2, hidden / 2}),
                           kv_v.view(DType::f32, {4, block, 2, hidden / 2}), block, 2, hidden / 2};
  Buffer ids_slot, x_slot, normed_slot, attn_slot, logits_slot, tokens_slot;
  const std::vector<std::int32_t> ids = {1, 2, 3, 4, 5, 6};
  const std::vector<std::int32_t> table_blocks = {2, 0};
  const std::vector<SequenceSlice> seqs = {{0, rows, 0, table_blocks}};
  const std::vector<SampleControls> controls(1);
  const std::int64_t last_row[] = {rows - 1};
  std::vector<std::int32_t> next(1);

  const auto step = [&] {
    const Tensor id_t = backend.scratch(ids_slot, DType::i32, {rows});
    backend.from_host(std::as_bytes(std::span(ids)), id_t);
    const Tensor x = backend.scratch(x_slot, DType::f32, {rows, hidden});
    backend.embedding(id_t, embed, x);
    const Tensor normed = backend.scratch(normed_slot, DType::f32, {rows, hidden});
    backend.rms_norm(x, norm_w, 1e-6F, normed);
    backend.kv_store(seqs, normed, normed, cache);
    const Tensor attn = backend.scratch(attn_slot, DType::f32, {rows, hidden});
    backend.paged_attention(seqs, normed, cache, {2, 0.5F, 0}, attn);
    backend.add(x, attn);
    const Tensor last = backend.scratch(normed_slot, DType::f32, {1, hidden});
    backend.gather_rows(x, last_row, last);
    const Tensor logits = backend.scratch(logits_slot, DType::f32, {1, vocab});
    backend.linear(last, embed, {}, logits);
    const Tensor tokens = backend.scratch(tokens_slot, DType::i32, {1});
    backend.sample(logits, controls, tokens);
    backend.to_host(tokens, std::as_writable_bytes(std::span(next)), HostSync::sampled_tokens);
  };
  step();  // warms the scratch slots
  cuda_emu::reset_counters();
  step();
  const cuda_emu::Counters c = cuda_emu::counters();
  EXPECT_EQ(c.host_syncs, 1);
  EXPECT_EQ(c.device_allocations, 0);
  EXPECT_EQ(c.device_frees, 0);
  EXPECT_EQ(c.host_allocations, 0);
  EXPECT_EQ(c.pageable_async_copies, 0);
  EXPECT_GT(c.kernel_launches, 7);
  EXPECT_EQ(backend.host_syncs(HostSync::sampled_tokens), 2);
}

// Also with a wait check (what --device cuda gives the backend for NCCL, cuda_rank_devices.cpp): the host
// then polls the stream instead of blocking in cudaStreamSynchronize, and each wait still counts once.
TEST(CudaBackendSyncs, AWholeModelDecodeStepWaitsTwicePerMoeLayerAndOnceToSample) {
  for (const bool polled : {false, true}) {
    SCOPED_TRACE(polled ? "polled waits (a wait check)" : "cudaStreamSynchronize");
    cuda::CudaBackend backend(0);
    if (polled) backend.set_wait_check([] {});
    const auto model = runtime::Model::load(testing::fixture_models_dir() / "qwen2_moe", backend);
    runtime::Engine engine(*model, {});
    const std::vector<std::int32_t> prompt = {3, 14, 15, 92, 65};
    std::vector<std::int32_t> next(1);
    const std::vector<SampleControls> greedy(1);
    std::vector<runtime::Engine::Work> work = {{1, prompt, false}};
    for (int step = 0; step < 3; ++step) {  // the prefill and two decodes warm every scratch slot
      ASSERT_TRUE(engine.step(work).ok());
      engine.sample(greedy, next);
      work = {{1, std::span(next), false}};
    }
    cuda_emu::reset_counters();
    ASSERT_TRUE(engine.step(work).ok());
    engine.sample(greedy, next);
    const cuda_emu::Counters c = cuda_emu::counters();
    const auto moe_layers = static_cast<std::int64_t>(model->moe_layers().size());
    ASSERT_GT(moe_layers, 0);
    EXPECT_EQ(c.host_syncs, 2 * moe_layers + 1);
    EXPECT_EQ(c.device_allocations, 0);
    EXPECT_EQ(c.pageable_async_copies, 0);
  }
}

// With a capacity factor every expert's load has a bound all ranks know, so a decode step exchanges its rows
// in fixed-size blocks and the host reads nothing until the sampled tokens, whose wait also brings the step's
// MoE statistics. The step runs inside a graph capture, which refuses every call that would make the host
// wait, allocate or copy from pageable memory (the emulation's cudaStreamBeginCapture), and neither it nor
// the sampling and statistics after it allocate host memory (the emulation's own allocations aside).
TEST(CudaBackendSyncs, ADecodeStepWithACapacityFactorWaitsOnceAllocatesNothingAndRunsUnderGraphCapture) {
  for (const char* name : {"qwen2_moe", "deepseek_v3"}) {
    SCOPED_TRACE(name);
    cuda::CudaBackend backend(0);
    runtime::ParallelOptions parallel;
    parallel.capacity.gamma = {1.0};
    const auto model = runtime::Model::load(testing::fixture_models_dir() / name, backend, parallel);
    runtime::EngineOptions options;
    options.max_step_tokens = 8;
    runtime::Engine engine(*model, options);
    const std::vector<std::int32_t> prompt = {3, 14, 15, 92, 65};
    std::vector<std::int32_t> next(2);
    const std::vector<SampleControls> greedy(2);
    std::vector<runtime::Engine::Work> work = {{1, std::span(prompt).first(3), false},
                                               {2, std::span(prompt).last(2), false}};
    ASSERT_TRUE(engine.step(work).ok());
    engine.sample(greedy, next);
    work = {{1, std::span(next).first(1), false, true}, {2, std::span(next).last(1), false, true}};
    ASSERT_TRUE(engine.step(work).ok());  // a decode step, to warm what decodes use
    engine.sample(greedy, next);
    (void)engine.moe_counts();  // as a server reads them every step

    cuda_emu::reset_counters();
    const std::int64_t counted_before = backend.host_syncs(HostSync::moe_dispatch);
    ASSERT_EQ(cudaStreamBeginCapture(backend.stream(), cudaStreamCaptureModeGlobal), cudaSuccess);
    std::optional<CountNews> host_news(std::in_place);
    const runtime::Status stepped = engine.step(work);
    const std::int64_t step_news = host_news->count();
    host_news.reset();
    cudaGraph_t graph = nullptr;
    const cudaError_t captured = cudaStreamEndCapture(backend.stream(), &graph);
    ASSERT_TRUE(stepped.ok()) << stepped.message();
    ASSERT_EQ(captured, cudaSuccess) << cudaGetErrorString(captured);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    host_news.emplace();
    engine.sample(greedy, next);
    const parallel::MoeStepStats& stats = engine.last_moe_stats();
    (void)engine.moe_counts();
    const std::int64_t sample_news = host_news->count();
    host_news.reset();
    const cuda_emu::Counters c = cuda_emu::counters();
    EXPECT_EQ(c.host_syncs, 1) << "the sampled tokens only";
    EXPECT_EQ(step_news, 0) << "host allocations in the step";
    EXPECT_EQ(sample_news, 0) << "host allocations in sampling and reading the statistics";
    EXPECT_EQ(c.device_allocations, 0);
    EXPECT_EQ(c.host_allocations, 0);
    EXPECT_EQ(c.pageable_async_copies, 0);
    EXPECT_EQ(backend.host_syncs(HostSync::moe_dispatch), counted_before) << "the counted exchange ran";
    EXPECT_EQ(backend.host_syncs(HostSync::moe_stats), 0);
    // The statistics arrived with the tokens: two tokens through every MoE layer, at most C = ceil(1.0 * 2 *
    // k / E) kept per expert.
    ASSERT_EQ(stats.layers.size(), model->moe_layers().size());
    const runtime::ModelConfig& config = model->config();
    const std::int64_t capacity = (2 * config.top_k + config.num_experts - 1) / config.num_experts;
    for (const parallel::MoeLayerStats& layer : stats.layers) {
      EXPECT_EQ(layer.tokens, 2);
      std::int64_t routed = 0;
      std::int64_t kept = 0;
      for (std::size_t e = 0; e < layer.routed_load.size(); ++e) {
        routed += layer.routed_load[e];
        kept += layer.expert_load[e];
        EXPECT_LE(layer.expert_load[e], capacity) << "expert " << e << " of layer " << layer.layer;
      }
      EXPECT_EQ(routed, 2 * config.top_k);
      EXPECT_EQ(kept + layer.dropped, 2 * config.top_k);
    }
  }
}

// A copy queued with to_host_later is in its destination once the next to_host returns, even a to_host of
// nothing (a rank without work samples zero rows), and a finish_host_copies after that has nothing to wait
// for. (An empty to_host used to return without waiting, and the statistics were read before they arrived.)
TEST(CudaBackendSyncs, QueuedCopiesArriveWithTheNextToHostEvenAnEmptyOne) {
  cuda::CudaBackend backend(0);
  const std::vector<std::int64_t> values = {3, 1, 4, 1, 5};
  Buffer slot;
  const Tensor t = backend.scratch(slot, DType::i64, {5});
  backend.from_host(std::as_bytes(std::span(values)), t);
  std::vector<std::int64_t> later(5, -1);
  backend.to_host_later(t, std::as_writable_bytes(std::span(later)));
  backend.to_host(t.rows(0, 0), {}, HostSync::sampled_tokens);
  EXPECT_EQ(later, values);
  cuda_emu::reset_counters();
  backend.finish_host_copies(HostSync::moe_stats);
  EXPECT_EQ(cuda_emu::counters().host_syncs, 0);
  EXPECT_EQ(backend.host_syncs(HostSync::moe_stats), 0);
  // Without a to_host, finish_host_copies waits, once.
  std::fill(later.begin(), later.end(), -1);
  backend.to_host_later(t, std::as_writable_bytes(std::span(later)));
  backend.finish_host_copies(HostSync::moe_stats);
  backend.finish_host_copies(HostSync::moe_stats);
  EXPECT_EQ(later, values);
  EXPECT_EQ(backend.host_syncs(HostSync::moe_stats), 1);
}

// A stream stalled behind work that never completes (an NCCL kernel whose peer died): a copy that laps the
// pinned staging ring waits for the device to have read a chunk. With a wait check (what --device cuda gives
// the backend for NCCL) that wait polls and ends with the check's exception, as to_host's does; it used to
// block in cudaEventSynchronize, on a GPU forever.
TEST(CudaBackendSyncs, ACopyLappingTheStagingRingBehindAStalledStreamEndsByTheWaitCheck) {
  cuda::CudaBackend backend(0);
  int polls = 0;
  backend.set_wait_check([&polls] {
    if (++polls == 3) throw std::runtime_error("the check saw the peer die");
  });
  const std::int64_t floats = std::int64_t{16} << 20;  // 64 MiB: twice the ring
  const std::vector<float> host(static_cast<std::size_t>(floats), 1.0F);
  Buffer slot;
  const Tensor dst = backend.scratch(slot, DType::f32, {floats});
  const cuda_emu::ScopedStreamHang stalled(backend.stream(), "the exchange waits for a rank that died");
  try {
    backend.from_host(std::as_bytes(std::span(host)), dst);
    ADD_FAILURE() << "the copy returned although the device cannot read what it laps";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the check saw the peer die");
  }
  EXPECT_EQ(polls, 3);
}

// The checkpoint's host memory (mmapped, or dequantized FP8 freed right after) is never a copy's source: the
// weights go through the backend's bounded pinned staging buffers.
TEST(CudaBackendSyncs, AModelUploadCopiesNothingFromPageableMemory) {
  cuda::CudaBackend backend(0);
  for (const char* name : {"qwen2_moe", "deepseek_v3_fp8"}) {
    cuda_emu::reset_counters();
    const auto model = runtime::Model::load(testing::fixture_models_dir() / name, backend);
    const cuda_emu::Counters c = cuda_emu::counters();
    EXPECT_EQ(c.pageable_async_copies, 0) << name;
    EXPECT_GT(c.copies, 0) << name;
  }
}

// After the engine's start-up reservation, steps of every size up to its maximum (prefills, decodes of as
// many sequences, both mixed; sampling, scoring with the most top log-probabilities, the router dry run)
// neither allocate nor free device memory, with the counted exchange or the fixed-size one; a larger step is
// refused.
TEST(CudaBackendSyncs, AfterStartUpNoStepUpToTheReservedSizeAllocates) {
  for (const auto& [name, gamma] : {std::pair{"qwen2_moe", 0.0}, std::pair{"deepseek_v3", 0.0},
                                    std::pair{"qwen2_moe", 1.0}, std::pair{"deepseek_v3", 1.5}}) {
    SCOPED_TRACE(std::string(name) + (gamma > 0 ? ", capacity factor " + std::to_string(gamma) : ""));
    cuda::CudaBackend backend(0);
    runtime::ParallelOptions parallel;
    if (gamma > 0) parallel.capacity.gamma = {gamma};  // the fixed-size exchange's buffers too
    const auto model = runtime::Model::load(testing::fixture_models_dir() / name, backend, parallel);
    constexpr std::int64_t kMax = 8;
    runtime::EngineOptions options;
    options.max_step_tokens = kMax;
    runtime::Engine engine(*model, options);
    cuda_emu::reset_counters();
    const std::vector<std::int32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79, 32};
    std::vector<std::int32_t> next(kMax);
    std::vector<std::int64_t> dry_counts(static_cast<std::size_t>(model->config().num_experts) *
                                         model->moe_layers().size());
    runtime::TokenLogprobs scored;
    runtime::SequenceId id = 0;
    for (std::int64_t n = 1; n <= kMax; ++n) {
      const auto un = static_cast<std::size_t>(n);
      // A prefill of n tokens with the logits of every position, scored.
      const runtime::SequenceId whole = ++id;
      const std::vector<runtime::Engine::Work> prefill = {{whole, std::span(prompt).first(un), true}};
      ASSERT_TRUE(engine.step(prefill).ok());
      engine.score(std::span(prompt).subspan(1, un), runtime::kMaxTopLogprobs, scored);
      // n one-token prompts, sampled; their n decodes, scored; one more decode beside a prompt of n - 1.
      std::vector<runtime::Engine::Work> work;
      for (std::size_t i = 0; i < un; ++i) work.push_back({++id, std::span(prompt).subspan(i, 1), false});
      const std::vector<kernels::SampleControls> greedy(un);
      ASSERT_TRUE(engine.step(work).ok());
      engine.sample(greedy, std::span(next).first(un));
      for (std::size_t i = 0; i < un; ++i) work[i].tokens = std::span(next).subspan(i, 1);
      ASSERT_TRUE(engine.step(work).ok());
      engine.score(std::span(next).first(un), runtime::kMaxTopLogprobs, scored);
      std::vector<runtime::Engine::Work> mixed = {{work[0].seq, std::span(next).first(1), false}};
      if (n > 1) mixed.push_back({whole, std::span(prompt).first(un - 1), false});
      ASSERT_TRUE(engine.step(mixed).ok());
      engine.sample(std::span(greedy).first(mixed.size()), std::span(next).first(mixed.size()));
      engine.router_dry_run(std::span(prompt).first(un),
                            static_cast<std::int64_t>(model->moe_layers().size()), dry_counts);
      for (const auto& w : work) engine.release(w.seq);
      engine.release(whole);
    }
    const std::vector<runtime::Engine::Work> too_big = {{++id, std::span(prompt).first(kMax + 1), false}};
    const runtime::Status refused = engine.step(too_big);
    EXPECT_EQ(refused.code(), runtime::StatusCode::invalid_argument) << refused.message();
    const cuda_emu::Counters c = cuda_emu::counters();
    EXPECT_EQ(c.device_allocations, 0);
    EXPECT_EQ(c.device_frees, 0);
    EXPECT_EQ(c.host_allocations, 0);
  }
}

}  // namespace
}  // namespace capserve::kernels
