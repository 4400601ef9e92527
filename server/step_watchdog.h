#pragma once
// Rank 0's guard against a step that never ends: a hung or stopped rank blocks every rank's step loop in a
// collective (the plan broadcast, the MoE all-to-all, the result gather), and nothing else would notice. The
// step loop brackets each step with begin_step()/end_step(); a thread of the watchdog's own checks the
// running step every tick and, once it has run longer than `bound`, calls `on_stall` once (on that thread)
// with a description naming the ranks whose heartbeats stopped. From then on end_step() returns false: the
// step loop must leave everything to on_stall (which ends the process).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "parallel/rank_heartbeat.h"

namespace capserve::server {

class StepWatchdog {
 public:
  using Clock = std::chrono::steady_clock;
  using StallHandler = std::function<void(const std::string& why)>;

  // `heartbeat` (may be null: the stalled ranks are then not named) is polled from the watchdog's thread
  // only.
  StepWatchdog(Clock::duration bound, parallel::RankHeartbeat* heartbeat, StallHandler on_stall);
  ~StepWatchdog();
  StepWatchdog(const StepWatchdog&) = delete;
  StepWatchdog& operator=(const StepWatchdog&) = delete;

  // Step loop: one atomic store.
  void begin_step();
  // Step loop: true, or false when the watchdog fired during this step.
  [[nodiscard]] bool end_step();

  // How long a rank's heartbeat may be silent before it counts as stalled, for a given bound.
  static Clock::duration silence_for(Clock::duration bound) { return bound / 2; }
  // How often every other rank beats, for a given bound: often enough that silence_for() spans many beats.
  static std::chrono::milliseconds beat_interval(Clock::duration bound);

 private:
  // step_start_ns_ holds the running step's start (steady clock, ns) or one of these.
  static constexpr std::int64_t kIdle = -1;
  static constexpr std::int64_t kFired = -2;

  void watch();
  [[nodiscard]] std::string describe(Clock::duration stalled_for);

  Clock::duration bound_;
  parallel::RankHeartbeat* heartbeat_;
  StallHandler on_stall_;
  std::atomic<std::int64_t> step_start_ns_{kIdle};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace capserve::server
