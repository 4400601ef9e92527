#include "tools/loadgen/stream_client.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <utility>

namespace capserve::loadgen {
namespace {

namespace v1 = capserve::v1;

void fill_sampling(const ClientOptions& o, const RequestSpec& spec, v1::SamplingOptions& s) {
  s.set_max_tokens(static_cast<std::uint32_t>(std::max<std::int64_t>(spec.max_tokens, 1)));
  s.set_temperature(o.temperature);
  s.set_top_p(o.top_p);
  s.set_top_k(o.top_k);
  s.set_seed(o.seed + spec.index);
  s.set_ignore_eos(o.ignore_eos);
}

std::int64_t content_of(const v1::ChatChunk& c) {
  return c.delta().empty() ? 0 : 1;
}
std::int64_t content_of(const v1::GenerateChunk& c) {
  return c.token_ids_size();
}

RequestRecord record_of(const RequestSpec& spec) {
  RequestRecord r;
  r.index = spec.index;
  r.domain = spec.domain;
  r.prompt_tokens_target = spec.prompt_tokens_target;
  r.max_tokens = spec.max_tokens;
  r.scheduled_s = spec.scheduled_s;
  return r;
}

}  // namespace

class StreamClient::Call {
 public:
  virtual ~Call() = default;
  virtual void go(v1::Inference::Stub& stub) = 0;
  virtual void cancel() = 0;
};

namespace {

// One streamed request: the request message, its context and its record live here until gRPC's OnDone.
template <typename Request, typename Chunk>
class StreamCall final : public StreamClient::Call, public grpc::ClientReadReactor<Chunk> {
 public:
  StreamCall(StreamClient& owner, Request request, RequestRecord record, std::chrono::milliseconds deadline)
      : owner_(owner), request_(std::move(request)), record_(std::move(record)) {
    if (deadline.count() > 0) context_.set_deadline(std::chrono::system_clock::now() + deadline);
  }

  void go(v1::Inference::Stub& stub) override {
    record_.sent_s = owner_.now_s();
    if constexpr (std::is_same_v<Request, v1::ChatRequest>) {
      stub.async()->ChatStream(&context_, &request_, this);
    } else {
      stub.async()->Generate(&context_, &request_, this);
    }
    this->StartRead(&chunk_);
    this->StartCall();
  }

  void cancel() override { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    const double t = owner_.now_s();
    if (final_seen_) record_.protocol_errors.push_back("chunk after the final chunk");
    const std::int64_t content = content_of(chunk_);
    if (content > 0) {
      if (!record_.first_token_s) {
        record_.first_token_s = t;
      } else {
        record_.itl_s.push_back(t - *record_.last_token_s);
      }
      record_.last_token_s = t;
      ++record_.content_chunks;
      if constexpr (std::is_same_v<Chunk, v1::GenerateChunk>) record_.streamed_tokens += content;
    }
    if (chunk_.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      final_seen_ = true;
      record_.finish_reason = chunk_.finish_reason();
      record_.prompt_tokens = chunk_.usage().prompt_tokens();
      record_.completion_tokens = chunk_.usage().completion_tokens();
      record_.moe_dropped = chunk_.moe().dropped();
      record_.moe_rerouted = chunk_.moe().rerouted();
    }
    this->StartRead(&chunk_);
  }

  void OnDone(const grpc::Status& status) override {
    record_.done_s = owner_.now_s();
    record_.status = status.error_code();
    record_.status_message = status.error_message();
    if (status.ok() && !final_seen_) record_.protocol_errors.push_back("OK status without a final chunk");
    if (!status.ok() && final_seen_)
      record_.protocol_errors.push_back("error status after a final chunk with finish_reason");
    if constexpr (std::is_same_v<Chunk, v1::GenerateChunk>) {
      if (status.ok() && record_.streamed_tokens > record_.completion_tokens)
        record_.protocol_errors.push_back("more token ids streamed than usage.completion_tokens");
    }
    // Destroys this call: nothing may touch a member after it.
    owner_.on_done(record_.index, std::move(record_));
  }

 private:
  StreamClient& owner_;
  grpc::ClientContext context_;
  Request request_;
  Chunk chunk_;
  RequestRecord record_;
  bool final_seen_ = false;
};

}  // namespace

StreamClient::StreamClient(const std::shared_ptr<grpc::Channel>& channel, ClientOptions options,
                           Clock::time_point t0)
    : stub_(v1::Inference::NewStub(channel)), options_(std::move(options)), t0_(t0) {}

StreamClient::~StreamClient() {
  {
    std::unique_lock lock(mutex_);
    if (changed_.wait_for(lock, std::chrono::seconds(10), [this] { return calls_.empty(); })) return;
  }
  if (abandon_in_flight(std::chrono::seconds(5)).unterminated > 0) {
    // gRPC still owns these reactors and may call them: destroying them (or the stub) is not safe.
    std::fprintf(stderr, "capserve-loadgen: %lld streams never ended, even when cancelled; exiting\n",
                 static_cast<long long>(in_flight()));
    std::_Exit(1);
  }
}

double StreamClient::now_s() const {
  return std::chrono::duration<double>(Clock::now() - t0_).count();
}

void StreamClient::start(RequestSpec spec) {
  std::shared_ptr<Call> call;
  if (options_.mode == CallMode::chat) {
    v1::ChatRequest request;
    request.set_model(options_.model);
    v1::ChatMessage* m = request.add_messages();
    m->set_role("user");
    m->set_content(spec.text);
    fill_sampling(options_, spec, *request.mutable_sampling());
    request.set_request_id("loadgen-" + std::to_string(spec.index));
    call = std::make_shared<StreamCall<v1::ChatRequest, v1::ChatChunk>>(*this, std::move(request),
                                                                        record_of(spec), options_.deadline);
  } else {
    v1::GenerateRequest request;
    request.set_model(options_.model);
    request.mutable_input_ids()->Add(spec.ids.begin(), spec.ids.end());
    fill_sampling(options_, spec, *request.mutable_sampling());
    request.set_request_id("loadgen-" + std::to_string(spec.index));
    call = std::make_shared<StreamCall<v1::GenerateRequest, v1::GenerateChunk>>(
        *this, std::move(request), record_of(spec), options_.deadline);
  }
  Call* raw = call.get();
  {
    std::lock_guard lock(mutex_);
    calls_.emplace(spec.index, std::move(call));
    max_in_flight_ = std::max(max_in_flight_, static_cast<std::int64_t>(calls_.size()));
  }
  // Nothing can end the call before it starts, so it is still in calls_ here.
  raw->go(*stub_);
}

void StreamClient::on_done(std::uint64_t index, RequestRecord record) {
  std::shared_ptr<Call> done;
  {
    std::lock_guard lock(mutex_);
    record.lost = lost_.contains(index);
    if (auto it = calls_.find(index); it != calls_.end()) {
      done = std::move(it->second);
      calls_.erase(it);
    } else {
      record.protocol_errors.push_back("a second terminal status");  // gRPC promises exactly one
    }
    finished_.push_back(std::move(record));
  }
  changed_.notify_all();
  // `done` (the caller) is destroyed here unless abandon_in_flight still holds it.
}

std::int64_t StreamClient::in_flight() const {
  std::lock_guard lock(mutex_);
  return static_cast<std::int64_t>(calls_.size());
}

std::int64_t StreamClient::max_in_flight() const {
  std::lock_guard lock(mutex_);
  return max_in_flight_;
}

std::int64_t StreamClient::wait_below(std::int64_t n, Clock::time_point until) {
  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, until, [&] { return static_cast<std::int64_t>(calls_.size()) < n; });
  return static_cast<std::int64_t>(calls_.size());
}

std::vector<RequestRecord> StreamClient::take_finished() {
  std::lock_guard lock(mutex_);
  return std::exchange(finished_, {});
}

StreamClient::Abandoned StreamClient::abandon_in_flight(std::chrono::milliseconds grace) {
  Abandoned a;
  std::vector<std::shared_ptr<Call>> pending;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [index, call] : calls_) {
      if (lost_.insert(index).second) ++a.lost;
      pending.push_back(call);
    }
  }
  // Outside the lock: gRPC may run a call's OnDone (which takes it) inside TryCancel.
  for (const auto& call : pending) call->cancel();
  pending.clear();
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, grace, [this] { return calls_.empty(); });
  a.unterminated = static_cast<std::int64_t>(calls_.size());
  return a;
}

}  // namespace capserve::loadgen
