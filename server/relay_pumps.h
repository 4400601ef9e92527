#pragma once
// Where gRPC calls take their requests' events: a thread of its own, woken by each request's listener. The
// listener runs on the engine loop's thread (Request::push), which must not build protobuf messages or write
// to sockets between steps; it only queues the call's relay here, once however many events come before the
// relay runs. A call waiting for its next event holds no thread: hundreds of streams share this one.
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <vector>

namespace capserve::server {

class RelayPumps {
 public:
  // A call's relay: pump() takes the events that have come and sends what it can.
  class Pumped {
   public:
    Pumped() = default;
    Pumped(const Pumped&) = delete;
    Pumped& operator=(const Pumped&) = delete;
    virtual ~Pumped() = default;
    virtual void pump() = 0;

   private:
    friend class RelayPumps;
    std::atomic<bool> queued_{false};
  };

  RelayPumps();
  RelayPumps(const RelayPumps&) = delete;
  RelayPumps& operator=(const RelayPumps&) = delete;
  ~RelayPumps();

  // Any thread: runs `relay`'s pump soon, unless the relay has ended or is queued already (that pump takes
  // this event too: the flag is cleared before it runs).
  void post(const std::weak_ptr<Pumped>& relay);

 private:
  void run(const std::stop_token& stop);

  std::mutex mutex_;
  std::condition_variable_any ready_;
  std::vector<std::weak_ptr<Pumped>> queue_;  // guarded by mutex_; its capacity is reused
  std::vector<std::weak_ptr<Pumped>> batch_;  // the pump thread's
  std::jthread thread_;                       // last: starts once the rest exists
};

}  // namespace capserve::server
