#include "server/step_loop.h"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <thread>

namespace capserve::server {
namespace {

// After the drain, requests already on the wire still reach a handler and get UNAVAILABLE from intake;
// gRPC's shutdown would cancel them instead (CANCELLED), which a client cannot tell from its own
// cancellation.
constexpr auto kDrainLinger = std::chrono::milliseconds(300);
// How long an idle loop waits for work before it looks at the signals again.
constexpr auto kIdleWait = std::chrono::milliseconds(50);
constexpr auto kDrainingWait = std::chrono::milliseconds(10);
// What calls in flight get once the loop ends: after a drain, after a failed step, after a stall (the
// handlers deliver the failed requests' statuses within milliseconds; health reads NOT_SERVING meanwhile).
constexpr auto kDrainedGrace = std::chrono::seconds(5);
constexpr auto kFailedGrace = std::chrono::seconds(2);
constexpr auto kStalledGrace = std::chrono::seconds(1);

// After the watchdog fired: the step loop waits for its stall handler to end the process.
[[noreturn]] void wait_for_stall_handler() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace

StepLoop::StepLoop(parallel::MpiWorld& world, RankWorker& worker, runtime::Engine& engine,
                   Scheduler& scheduler, ServerMetrics& metrics, FrontEndControl& front_ends, Signals signals,
                   StepWatchdog::Clock::duration step_bound, parallel::RankHeartbeat* heartbeat,
                   StepTraceWriter* trace)
    : world_(world),
      worker_(worker),
      engine_(engine),
      scheduler_(scheduler),
      metrics_(metrics),
      front_ends_(front_ends),
      signals_(signals),
      trace_(trace),
      shape_(world.size()),
      watchdog_(step_bound, heartbeat, [this](const std::string& why) { on_stall(why); }) {}

int StepLoop::run() {
  try {
    for (;;) {
      heed_signals();
      if (!scheduler_.idle()) {
        step();
      } else if (drained()) {
        break;
      } else {
        scheduler_.wait_for_work(draining_ ? kDrainingWait : kIdleWait);
      }
    }
  } catch (const std::exception& e) {
    fail(e);
  }
  send_shutdown_plan();
  front_ends_.shutdown(std::chrono::system_clock::now() + kDrainedGrace);
  spdlog::info("capserve: drained, exiting");
  return 0;
}

int StepLoop::follow(parallel::MpiWorld& world, RankWorker& worker) {
  for (;;) {
    std::vector<std::byte> bytes;
    world.broadcast(bytes, 0);
    const StepPlan plan = deserialize_plan(bytes);
    if (plan.shutdown) return 0;
    const StepResult result = worker.run(plan);
    world.gather(serialize(result), 0);
  }
}

void StepLoop::heed_signals() {
  if (const int n = signals_.sigusr2_received.exchange(0); n > 0)
    spdlog::warn("capserve: SIGUSR2 received ({}x) and ignored (SIGTERM, SIGINT or SIGHUP drains)", n);
  if (draining_ || !signals_.stop_requested.load()) return;
  // The scheduler refuses new requests since the signal; this ends admission for good, and health.
  spdlog::info("capserve: draining (no new requests; running ones finish)");
  scheduler_.drain();
  front_ends_.stop_serving();
  draining_ = true;
  drain_started_ = Clock::now();
}

bool StepLoop::drained() const {
  return draining_ && Clock::now() - drain_started_ >= kDrainLinger;
}

void StepLoop::step() {
  const Clock::time_point started = Clock::now();
  const StepPlan plan = scheduler_.plan(started);
  std::vector<std::byte> bytes = serialize(plan);
  watchdog_.begin_step();
  world_.broadcast(bytes, 0);
  const StepResult mine = worker_.run(plan);
  const auto gathered = world_.gather(serialize(mine), 0);
  end_watched();
  results_.clear();
  for (const auto& g : gathered) results_.push_back(deserialize_result(g));
  // The step's statistics first: once a request's end is visible (to its client, or in
  // capserve_requests_total), the work of its last step is already in /metrics.
  if (plan.has_work()) metrics_.record_step(engine_.last_moe_stats());
  scheduler_.complete(results_, engine_.last_moe_stats(), Clock::now());
  if (trace_ == nullptr) return;
  const std::span<const RankWork> work = shape_.apply(plan);
  if (plan.has_work()) {
    active_experts(engine_.last_moe_stats(), engine_.model().placement(), active_);
    if (!trace_->write(started, std::chrono::duration<double>(Clock::now() - started).count(), work,
                       engine_.last_moe_stats(), active_)) {
      spdlog::error(
          "capserve: --step-trace: cannot write the trace file any more; tracing stops, serving goes on");
      trace_ = nullptr;
    }
  }
}

void StepLoop::end_watched() {
  if (!watchdog_.end_step()) wait_for_stall_handler();
}

void StepLoop::fail(const std::exception& e) {
  end_watched();
  spdlog::error("capserve: step loop failed: {}", e.what());
  scheduler_.fail_all(Terminal::internal, std::string("server failure: ") + e.what());
  front_ends_.shutdown(std::chrono::system_clock::now() + kFailedGrace);
  world_.abort(1);
}

void StepLoop::on_stall(const std::string& why) {
  spdlog::error("capserve: {}; failing every request and stopping the job", why);
  front_ends_.mark_stalled();
  scheduler_.fail_all(Terminal::unavailable, why);
  std::this_thread::sleep_for(kStalledGrace);
  front_ends_.shutdown(std::chrono::system_clock::now() + kStalledGrace);
  std::fprintf(stderr, "capserve: %s\n", why.c_str());
  std::fflush(stderr);
  world_.abort(1);  // the stalled rank cannot take part in an orderly shutdown
}

void StepLoop::send_shutdown_plan() {
  StepPlan plan;
  plan.shutdown = true;
  std::vector<std::byte> bytes = serialize(plan);
  watchdog_.begin_step();
  world_.broadcast(bytes, 0);
  end_watched();
}

}  // namespace capserve::server
