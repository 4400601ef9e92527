#pragma once
// One client request as it travels between its front end (a gRPC call's reactor, or an HTTP connection on an
// I/O thread) and the engine loop: what was asked (immutable once submitted), and a channel of events back
// (text or token deltas, then exactly one terminal event). Neither front end holds a thread while it waits:
// it registers a listener, which push() calls, and drains the events with try_next(). The front end may flag
// the request cancelled at any time; the engine loop frees its sequence at the next step.
#include <atomic>
#include <chrono>
#include <condition_variable>  // scheduler.h relies on it through this header
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "runtime/sampler.h"
#include "server/logprob_entries.h"

namespace capserve::server {

using Clock = std::chrono::steady_clock;

// How a request ends. `ok_*` are normal completions; the rest map onto gRPC status codes.
enum class Terminal {
  ok_stop,
  ok_length,
  cancelled,
  deadline_exceeded,
  unavailable,
  internal,
  invalid_argument
};

struct RequestEvent {
  std::string text;                  // chat: new text (UTF-8 complete, never part of a stop string)
  std::vector<std::int32_t> tokens;  // generate: new token ids
  // When the request asks (SamplingParams::logprobs / prompt_logprobs): the entries of the tokens this
  // event's text or token ids cover, and, once (with the first event), those of the prompt's tokens after
  // the first.
  LogprobEntries logprobs;
  LogprobEntries prompt_logprobs;
  std::optional<Terminal> terminal;  // set on the last event only
  std::string message;               // for an error terminal
  std::uint32_t prompt_tokens = 0;
  std::uint32_t completion_tokens = 0;
  std::uint32_t cached_tokens = 0;  // of the prompt, taken from the prefix cache
  std::uint64_t moe_assignments = 0, moe_dropped = 0, moe_rerouted = 0;
};

// What the client receives of the generated tokens: text (chat, completions) or token ids (Generate); the
// text ends before the first stop string; special tokens spell nothing unless the request keeps them (vLLM's
// skip_special_tokens false).
struct OutputForm {
  bool text = true;
  std::vector<std::string> stop_strings;
  bool skip_special_tokens = true;
};

class Request {
 public:
  // peer: the client's address as its front end names it (gRPC: "ipv4:10.0.0.1:54321"), for the access log.
  // arrival: now, except in a simulation (the trace-driven planner runs the scheduler on its own clock).
  Request(std::string id, std::vector<std::int32_t> prompt, runtime::SamplingParams params, OutputForm output,
          Clock::time_point deadline, std::string peer = {}, Clock::time_point arrival = Clock::now())
      : id_(std::move(id)),
        prompt_(std::move(prompt)),
        params_(std::move(params)),
        output_(std::move(output)),
        deadline_(deadline),
        arrival_(arrival),
        peer_(std::move(peer)) {}

  [[nodiscard]] const std::string& id() const { return id_; }
  [[nodiscard]] const std::vector<std::int32_t>& prompt() const { return prompt_; }
  [[nodiscard]] const runtime::SamplingParams& params() const { return params_; }
  [[nodiscard]] const OutputForm& output() const { return output_; }
  [[nodiscard]] Clock::time_point arrival() const { return arrival_; }
  // The client's address ("ipv4:10.0.0.1:5000"), empty when unknown.
  [[nodiscard]] const std::string& peer() const { return peer_; }

  // Front end, before the request is submitted: called (on the engine loop's thread, so it must be quick and
  // must not call back into this request) after each push.
  void set_listener(std::function<void()> listener) { listener_ = std::move(listener); }

  // Front end: the client left. It ends the request as CANCELLED.
  void cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  [[nodiscard]] bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }
  // Front end: the client left because its deadline passed by its own clock (which runs out before ours by
  // the request's transit time). It ends the request as DEADLINE_EXCEEDED, as the deadline passing here does.
  void expire() { expired_.store(true, std::memory_order_relaxed); }
  [[nodiscard]] bool expired(Clock::time_point now) const {
    return now >= deadline_ || expired_.load(std::memory_order_relaxed);
  }

  // Engine loop side.
  void push(RequestEvent event) {
    {
      std::lock_guard lock(mutex_);
      events_.push_back(std::move(event));
    }
    if (listener_) listener_();
  }

  // Front end side: the next event, if one has come.
  std::optional<RequestEvent> try_next() {
    std::lock_guard lock(mutex_);
    if (events_.empty()) return std::nullopt;
    RequestEvent e = std::move(events_.front());
    events_.pop_front();
    return e;
  }

 private:
  const std::string id_;
  const std::vector<std::int32_t> prompt_;
  const runtime::SamplingParams params_;
  const OutputForm output_;
  const Clock::time_point deadline_;
  const Clock::time_point arrival_;
  const std::string peer_;
  std::function<void()> listener_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> expired_{false};
  std::mutex mutex_;
  std::deque<RequestEvent> events_;
};

}  // namespace capserve::server
