#pragma once
// Requests between the front ends' threads and the step loop: the handlers push, the step loop takes them all
// at once when it plans a step. It counts requests queued and not yet admitted against --max-queue, refuses
// once draining (after drain(), or once the stop signal's flag reads true: no request is accepted after the
// signal, even before the step loop calls drain()), and wakes the step loop when there is work.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/status.h"
#include "server/request.h"

namespace capserve::server {

class RequestQueue {
 public:
  RequestQueue(std::int64_t max_queue, const std::atomic<bool>* stop_requested)
      : max_queue_(max_queue), stop_requested_(stop_requested) {}

  // Handler threads. OK, or why it is refused now: UNAVAILABLE (draining), RESOURCE_EXHAUSTED (queue full).
  runtime::Status push(std::shared_ptr<Request> request);
  void drain();
  [[nodiscard]] bool draining() const;
  void wait_for_work(std::chrono::milliseconds timeout);

  // Step loop: hands every pushed request to `each`, oldest first.
  template <typename Each>
  void take(Each&& each) {
    std::lock_guard lock(mutex_);
    for (auto& r : inbox_) each(std::move(r));
    inbox_.clear();
  }
  [[nodiscard]] bool empty() const;
  // `n` taken requests left the queue (admitted or ended).
  void left(std::int64_t n);
  // Refuses everything from now on and forgets the count (the server is failing).
  void close();

 private:
  std::int64_t max_queue_;
  const std::atomic<bool>* stop_requested_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::vector<std::shared_ptr<Request>> inbox_;
  std::int64_t queued_ = 0;  // pushed and not yet left: the inbox and the scheduler's waiting requests
  bool draining_ = false;
};

}  // namespace capserve::server
