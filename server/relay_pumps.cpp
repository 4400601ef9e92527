#include "server/relay_pumps.h"

#include <utility>

namespace capserve::server {

RelayPumps::RelayPumps() : thread_([this](const std::stop_token& stop) { run(stop); }) {}

RelayPumps::~RelayPumps() {
  thread_.request_stop();
  thread_.join();
}

void RelayPumps::post(const std::weak_ptr<Pumped>& relay) {
  const std::shared_ptr<Pumped> r = relay.lock();
  if (!r || r->queued_.exchange(true)) return;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(relay);
  }
  ready_.notify_one();
}

void RelayPumps::run(const std::stop_token& stop) {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (!ready_.wait(lock, stop, [&] { return !queue_.empty(); })) return;
      std::swap(queue_, batch_);
    }
    for (const std::weak_ptr<Pumped>& relay : batch_) {
      if (const std::shared_ptr<Pumped> r = relay.lock()) {
        r->queued_.store(false);
        r->pump();
      }
    }
    batch_.clear();
  }
}

}  // namespace capserve::server
