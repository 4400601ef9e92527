// StepWatchdog: fires once, and only, when a step outlives its bound; afterwards end_step() hands the step
// over (false). Without a heartbeat the stalled ranks are not named.
#include "server/step_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

namespace capserve::server {
namespace {

using namespace std::chrono_literals;

struct Recorder {
  std::mutex mutex;
  std::string why;
  std::atomic<int> calls{0};
  StepWatchdog::StallHandler handler() {
    return [this](const std::string& w) {
      std::lock_guard lock(mutex);
      why = w;
      ++calls;
    };
  }
};

TEST(StepWatchdog, FiresOnceWhenAStepOutlivesTheBound) {
  Recorder stall;
  StepWatchdog watchdog(100ms, nullptr, stall.handler());
  watchdog.begin_step();
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (stall.calls == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(300ms);  // a second firing would show here
  EXPECT_EQ(stall.calls, 1);
  EXPECT_FALSE(watchdog.end_step());
  std::lock_guard lock(stall.mutex);
  EXPECT_NE(stall.why.find("a step made no progress for"), std::string::npos) << stall.why;
  EXPECT_NE(stall.why.find("limit 0.1 s, --step-timeout-s"), std::string::npos) << stall.why;
  EXPECT_EQ(stall.why.find("rank"), std::string::npos) << stall.why;
}

TEST(StepWatchdog, QuietWhileStepsEndWithinTheBoundAndWhileIdle) {
  Recorder stall;
  StepWatchdog watchdog(300ms, nullptr, stall.handler());
  for (int step = 0; step < 20; ++step) {
    watchdog.begin_step();
    std::this_thread::sleep_for(30ms);
    EXPECT_TRUE(watchdog.end_step());
  }
  std::this_thread::sleep_for(600ms);  // idle between steps is no stall
  EXPECT_EQ(stall.calls, 0);
}

TEST(StepWatchdog, BeatsOftenEnoughToDetectSilenceWithinTheBound) {
  EXPECT_EQ(StepWatchdog::beat_interval(3s), 300ms);
  EXPECT_EQ(StepWatchdog::beat_interval(60s), 1000ms);
  EXPECT_EQ(StepWatchdog::beat_interval(100ms), 20ms);
  EXPECT_GE(StepWatchdog::silence_for(60s) / StepWatchdog::beat_interval(60s), 10);
}

}  // namespace
}  // namespace capserve::server
