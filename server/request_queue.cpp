#include "server/request_queue.h"

namespace capserve::server {

runtime::Status RequestQueue::push(std::shared_ptr<Request> request) {
  {
    std::lock_guard lock(mutex_);
    if (draining_ || (stop_requested_ != nullptr && stop_requested_->load()))
      return {runtime::StatusCode::unavailable, "the server is shutting down"};
    if (queued_ >= max_queue_)
      return {runtime::StatusCode::resource_exhausted, "queue full: too many waiting requests; retry later"};
    ++queued_;
    inbox_.push_back(std::move(request));
  }
  ready_.notify_one();
  return {};
}

void RequestQueue::drain() {
  {
    std::lock_guard lock(mutex_);
    draining_ = true;
  }
  ready_.notify_one();
}

bool RequestQueue::draining() const {
  if (stop_requested_ != nullptr && stop_requested_->load()) return true;
  std::lock_guard lock(mutex_);
  return draining_;
}

void RequestQueue::wait_for_work(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return !inbox_.empty() || draining_; });
}

bool RequestQueue::empty() const {
  std::lock_guard lock(mutex_);
  return inbox_.empty();
}

void RequestQueue::left(std::int64_t n) {
  std::lock_guard lock(mutex_);
  queued_ -= n;
}

void RequestQueue::close() {
  std::lock_guard lock(mutex_);
  queued_ = 0;
  draining_ = true;
}

}  // namespace capserve::server
