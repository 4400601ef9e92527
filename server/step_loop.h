#pragma once
// The lockstep step loop (server/README.md, "Process roles"). Rank 0 drives it (StepLoop::run): each step
// its scheduler plans, the plan is broadcast, every rank runs it on its engine (RankWorker), the results are
// gathered back and the scheduler completes them; while idle it waits for work; a stop signal drains (no new
// requests, running ones finish), and a drained loop sends every rank the shutdown plan. The other ranks
// follow rank 0's plans (StepLoop::follow) until that plan. The step watchdog brackets each step: a step
// that never ends (a hung rank) fails every request and aborts the job, as does a step that throws.
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "parallel/mpi_world.h"
#include "parallel/rank_heartbeat.h"
#include "runtime/engine.h"
#include "server/rank_worker.h"
#include "server/scheduler.h"
#include "server/server_metrics.h"
#include "server/step_plan.h"
#include "server/step_shape.h"
#include "server/step_trace.h"
#include "server/step_watchdog.h"

namespace capserve::server {

// What the step loop asks of rank 0's front ends (gRPC, the HTTP API, health checks), which main.cpp wires.
class FrontEndControl {
 public:
  virtual ~FrontEndControl() = default;
  // The drain began: renders in progress are cancelled and health reads NOT_SERVING.
  virtual void stop_serving() = 0;
  // The step watchdog fired: health reads NOT_SERVING and /health answers 503, for good.
  virtual void mark_stalled() = 0;
  // Stops the servers; calls still in flight get until `deadline`.
  virtual void shutdown(std::chrono::system_clock::time_point deadline) = 0;
};

class StepLoop {
 public:
  // The process's signal flags, which its handlers set.
  struct Signals {
    const std::atomic<bool>& stop_requested;  // drain
    std::atomic<int>& sigusr2_received;       // received and not yet logged
  };

  // Rank 0. Every reference must outlive the loop; `heartbeat` (may be null) names a stalled rank; `trace`
  // (may be null) records every step that computes something.
  StepLoop(parallel::MpiWorld& world, RankWorker& worker, runtime::Engine& engine, Scheduler& scheduler,
           ServerMetrics& metrics, FrontEndControl& front_ends, Signals signals,
           StepWatchdog::Clock::duration step_bound, parallel::RankHeartbeat* heartbeat,
           StepTraceWriter* trace = nullptr);
  StepLoop(const StepLoop&) = delete;
  StepLoop& operator=(const StepLoop&) = delete;

  // Steps until a stop signal's drain has ended, then sends every rank the shutdown plan and stops the front
  // ends: 0. A step that throws fails every request INTERNAL and aborts the job; one that stalls is left to
  // the watchdog, which fails every request UNAVAILABLE and aborts the job.
  int run();

  // Every other rank: runs rank 0's plans until the shutdown plan: 0.
  static int follow(parallel::MpiWorld& world, RankWorker& worker);

 private:
  // Logs the SIGUSR2s received; on the first stop signal, drains.
  void heed_signals();
  // Draining, idle, and past the linger that lets requests already on the wire get UNAVAILABLE.
  [[nodiscard]] bool drained() const;
  // One step on every rank: plan, broadcast, run, gather, metrics, complete.
  void step();
  // Rank 0's bracket around a collective: the watchdog's; after it fired, the stall handler ends the process.
  void end_watched();
  [[noreturn]] void fail(const std::exception& e);
  // The watchdog's stall handler (on its thread, while the step loop is stuck in a collective).
  [[noreturn]] void on_stall(const std::string& why);
  void send_shutdown_plan();

  parallel::MpiWorld& world_;
  RankWorker& worker_;
  runtime::Engine& engine_;
  Scheduler& scheduler_;
  ServerMetrics& metrics_;
  FrontEndControl& front_ends_;
  Signals signals_;
  bool draining_ = false;
  Clock::time_point drain_started_{};
  std::vector<StepResult> results_;  // the ranks' results of the step, reused
  StepTraceWriter* trace_;
  StepShape shape_;                   // followed only with a trace
  std::vector<std::int64_t> active_;  // the trace's active experts per layer and rank, reused
  // Last: destroyed first, so that its thread never calls on_stall on a loop being torn down.
  StepWatchdog watchdog_;
};

}  // namespace capserve::server
