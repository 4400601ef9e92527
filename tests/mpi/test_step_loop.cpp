// StepLoop under mpirun -np 1 and 2 (and as a singleton): rank 0 runs the loop over its scheduler and the
// other ranks follow its plans. A stop signal given before the loop starts drains: the requests already
// submitted still finish with transformers' greedy continuation (the fixture's reference, gamma = inf), the
// front ends are told once to stop serving and once to shut down, never that a step stalled, every rank
// leaves its loop on the shutdown plan, and the SIGUSR2s received are consumed.
#include "server/step_loop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/mpi_communicator.h"
#include "runtime/model.h"
#include "runtime/router_load_predictor.h"
#include "tests/mpi/mpi_gtest_main.h"
#include "tests/unit/runtime/fixture_models.h"

namespace capserve::server {
namespace {

class RecordingFrontEnds final : public FrontEndControl {
 public:
  void stop_serving() override { ++stop_serving_calls; }
  void mark_stalled() override { ++mark_stalled_calls; }
  void shutdown(std::chrono::system_clock::time_point) override { ++shutdown_calls; }

  int stop_serving_calls = 0, mark_stalled_calls = 0, shutdown_calls = 0;
};

// A request's token ids and its terminal, from the events the loop pushed.
struct Outcome {
  std::vector<std::int32_t> tokens;
  std::optional<Terminal> terminal;
};
Outcome outcome(Request& request) {
  Outcome o;
  while (std::optional<RequestEvent> e = request.try_next()) {
    o.tokens.insert(o.tokens.end(), e->tokens.begin(), e->tokens.end());
    if (e->terminal) o.terminal = e->terminal;
  }
  return o;
}

TEST(StepLoop, ADrainFinishesTheSubmittedRequestsThenStopsEveryRank) {
  parallel::MpiWorld& world = test::mpi_world();
  parallel::MpiCommunicator comm;  // collective: every rank builds it
  kernels::cpu::CpuBackend backend{1};
  const std::string fixture = "olmoe_bf16";
  const auto model = runtime::Model::load(testing::fixture_models_dir() / fixture, backend, comm, {});
  runtime::Engine engine(*model, {});
  RankWorker worker(engine, world.rank());
  if (world.rank() != 0) {
    EXPECT_EQ(StepLoop::follow(world, worker), 0);
    return;
  }

  const runtime::ModelConfig& c = model->config();
  MetricsOptions metrics_options;
  metrics_options.model_name = fixture;
  ServerMetrics metrics(model->moe_layers(), c.num_experts, world.size(), metrics_options);
  SchedulerConfig config;
  config.max_context = c.max_context_length();
  config.assignments_per_token = c.top_k * static_cast<std::int64_t>(model->moe_layers().size());
  runtime::RouterLoadPredictor predictor(engine, model->placement(), 1);
  Scheduler scheduler(config, world.size(), nullptr, &predictor, &metrics);
  std::vector<std::shared_ptr<Request>> requests;
  std::vector<std::vector<std::int32_t>> expected;
  for (const auto& p : testing::fixture_reference(fixture)["prompts"]) {
    expected.push_back(p["greedy_ids"].get<std::vector<std::int32_t>>());
    runtime::SamplingParams greedy;
    greedy.max_new_tokens = static_cast<std::int64_t>(expected.back().size());
    requests.push_back(std::make_shared<Request>(
        std::to_string(requests.size()), p["input_ids"].get<std::vector<std::int32_t>>(), greedy,
        OutputForm{.text = false, .stop_strings = {}, .skip_special_tokens = true},
        Clock::time_point::max()));
    ASSERT_TRUE(scheduler.submit(requests.back()).ok());
  }

  const std::atomic<bool> stop_requested{true};
  std::atomic<int> sigusr2_received{2};
  RecordingFrontEnds front_ends;
  StepLoop loop(world, worker, engine, scheduler, metrics, front_ends, {stop_requested, sigusr2_received},
                std::chrono::minutes(10), nullptr);
  EXPECT_EQ(loop.run(), 0);

  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Outcome o = outcome(*requests[i]);
    EXPECT_EQ(o.terminal, Terminal::ok_length) << "request " << i;
    EXPECT_EQ(o.tokens, expected[i]) << "request " << i;
  }
  EXPECT_TRUE(scheduler.idle());
  EXPECT_TRUE(scheduler.draining());
  EXPECT_EQ(front_ends.stop_serving_calls, 1);
  EXPECT_EQ(front_ends.shutdown_calls, 1);
  EXPECT_EQ(front_ends.mark_stalled_calls, 0);
  EXPECT_EQ(sigusr2_received.load(), 0);
}

}  // namespace
}  // namespace capserve::server
