#include "server/step_watchdog.h"

#include <algorithm>
#include <cstdio>

namespace capserve::server {
namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(StepWatchdog::Clock::now().time_since_epoch())
      .count();
}

std::string seconds(StepWatchdog::Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(d).count());
  return text;
}

}  // namespace

std::chrono::milliseconds StepWatchdog::beat_interval(Clock::duration bound) {
  const auto tenth = std::chrono::duration_cast<std::chrono::milliseconds>(bound / 10);
  return std::clamp(tenth, std::chrono::milliseconds(20), std::chrono::milliseconds(1000));
}

StepWatchdog::StepWatchdog(Clock::duration bound, parallel::RankHeartbeat* heartbeat, StallHandler on_stall)
    : bound_(bound), heartbeat_(heartbeat), on_stall_(std::move(on_stall)) {
  thread_ = std::thread([this] { watch(); });
}

StepWatchdog::~StepWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void StepWatchdog::begin_step() {
  step_start_ns_.store(now_ns(), std::memory_order_release);
}

bool StepWatchdog::end_step() {
  std::int64_t start = step_start_ns_.load(std::memory_order_acquire);
  while (start != kFired) {
    if (step_start_ns_.compare_exchange_weak(start, kIdle, std::memory_order_acq_rel)) return true;
  }
  return false;
}

std::string StepWatchdog::describe(Clock::duration stalled_for) {
  std::string why;
  if (heartbeat_ != nullptr) {
    const std::vector<int> silent = heartbeat_->silent_ranks(silence_for(bound_));
    for (std::size_t i = 0; i < silent.size(); ++i)
      why += (i == 0 ? (silent.size() == 1 ? "rank " : "ranks ") : ", ") + std::to_string(silent[i]);
    if (!silent.empty()) why += " stopped responding: ";
  }
  why += "a step made no progress for " + seconds(stalled_for) + " (limit " + seconds(bound_) +
         ", --step-timeout-s)";
  return why;
}

void StepWatchdog::watch() {
  const auto tick = std::min<Clock::duration>(beat_interval(bound_) / 2, std::chrono::milliseconds(100));
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, tick, [&] { return stop_; })) {
    if (heartbeat_ != nullptr) heartbeat_->poll();
    std::int64_t start = step_start_ns_.load(std::memory_order_acquire);
    if (start < 0) continue;
    const auto stalled_for = std::chrono::nanoseconds(now_ns() - start);
    if (stalled_for <= bound_) continue;
    if (!step_start_ns_.compare_exchange_strong(start, kFired, std::memory_order_acq_rel)) continue;
    lock.unlock();
    on_stall_(describe(stalled_for));
    return;
  }
}

}  // namespace capserve::server
