#pragma once
// Many concurrent streamed requests from a few threads: each request is a gRPC callback reactor
// (grpc::ClientReadReactor) on ChatStream or Generate, driven by gRPC's own threads, timing every chunk as it
// arrives. Each request yields exactly one RequestRecord, made when gRPC reports its terminal status; a
// request still without one when the run gives up waiting is LOST (and then cancelled so that it can be
// cleaned up).
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "capserve/v1/inference.grpc.pb.h"

namespace capserve::loadgen {

using Clock = std::chrono::steady_clock;

enum class CallMode { chat, generate };

struct ClientOptions {
  CallMode mode = CallMode::chat;
  std::string model;  // empty: the served model
  float temperature = 0;
  float top_p = 0;
  std::uint32_t top_k = 0;
  std::uint64_t seed = 0;  // per request: seed + request index
  bool ignore_eos = false;
  std::chrono::milliseconds deadline{0};  // per request; 0: none
};

struct RequestSpec {
  std::uint64_t index = 0;
  std::string domain;
  std::int64_t prompt_tokens_target = 0;
  std::int64_t max_tokens = 0;
  double scheduled_s = 0;
  std::string text;               // chat
  std::vector<std::int32_t> ids;  // generate
};

struct RequestRecord {
  std::uint64_t index = 0;
  std::string domain;
  std::int64_t prompt_tokens_target = 0;
  std::int64_t max_tokens = 0;
  double scheduled_s = 0;  // all times in seconds since the run started
  double sent_s = 0;
  std::optional<double> first_token_s;
  std::optional<double> last_token_s;
  std::vector<double> itl_s;  // gaps between successive chunks that carry text or tokens
  double done_s = 0;
  grpc::StatusCode status = grpc::StatusCode::UNKNOWN;
  std::string status_message;
  capserve::v1::FinishReason finish_reason = capserve::v1::FINISH_REASON_UNSPECIFIED;
  std::uint32_t prompt_tokens = 0;      // the server's count (usage), OK requests only
  std::uint32_t completion_tokens = 0;  // idem
  std::int64_t content_chunks = 0;
  std::int64_t streamed_tokens = 0;  // generate: token ids received
  std::uint64_t moe_dropped = 0;
  std::uint64_t moe_rerouted = 0;
  bool lost = false;  // no terminal status in time; `status` is then the one its cancellation produced
  // Breaches of the API's stream contract (a final chunk before the end, OK without a final chunk, ...).
  std::vector<std::string> protocol_errors;
};

class StreamClient {
 public:
  StreamClient(const std::shared_ptr<grpc::Channel>& channel, ClientOptions options, Clock::time_point t0);
  // Waits (bounded) for calls still in flight, then abandons them; a call that gRPC never ends even after
  // cancellation leaves nothing safe to do, so the process exits (status 1) with a message. Callers that care
  // abandon and report first.
  ~StreamClient();
  StreamClient(const StreamClient&) = delete;
  StreamClient& operator=(const StreamClient&) = delete;

  // Starts one request; returns at once.
  void start(RequestSpec spec);

  [[nodiscard]] std::int64_t in_flight() const;
  [[nodiscard]] std::int64_t max_in_flight() const;
  // Blocks until fewer than `n` requests are in flight or `until` passes; the in-flight count then.
  std::int64_t wait_below(std::int64_t n, Clock::time_point until);
  // Records of the requests finished since the last call.
  std::vector<RequestRecord> take_finished();

  // Marks every request still in flight as lost, cancels it, and waits up to `grace` for gRPC to end it
  // (its record then comes through take_finished with lost set). Returns how many were lost, and how many
  // never ended even after cancellation.
  struct Abandoned {
    std::int64_t lost = 0;
    std::int64_t unterminated = 0;
  };
  Abandoned abandon_in_flight(std::chrono::milliseconds grace);

  // gRPC side.
  class Call;
  void on_done(std::uint64_t index, RequestRecord record);
  [[nodiscard]] double now_s() const;

 private:
  std::unique_ptr<capserve::v1::Inference::Stub> stub_;
  ClientOptions options_;
  Clock::time_point t0_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // Shared so that a call being cancelled outlives its OnDone, which may run inside the cancellation.
  std::unordered_map<std::uint64_t, std::shared_ptr<Call>> calls_;
  std::set<std::uint64_t> lost_;
  std::vector<RequestRecord> finished_;
  std::int64_t max_in_flight_ = 0;
};

}  // namespace capserve::loadgen
