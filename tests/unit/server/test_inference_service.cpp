// The gRPC service in-process, over a real scheduler driven step by step (no ranks): streams wait on their
// request's events, so 200 open streams hold no thread each (the process's thread count, from
// /proc/self/status, stays bounded); a client that cancels its stream cancels its request at once; a refused
// request gets its status before anything reaches the scheduler.
#include "server/inference_service.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/unit/server/scheduler_steps.h"
#include "tests/unit/server/tiny_tokenizer.h"

namespace capserve::server {
namespace {

namespace v1 = capserve::v1;

// The process's threads, as the kernel counts them.
int process_threads() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("Threads:")) return std::stoi(line.substr(8));
  }
  ADD_FAILURE() << "no Threads line in /proc/self/status";
  return 0;
}

// One Generate call read through a completion queue: the client side holds no thread per call either.
struct Call {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientAsyncReader<v1::GenerateChunk>> reader;
  v1::GenerateChunk chunk;
  grpc::Status status;
  std::int64_t tokens = 0;
  bool finished = false;
};

class InferenceServiceTest : public testing::Test {
 protected:
  InferenceServiceTest()
      : tokenizer_(load_tiny_tokenizer()),
        scheduler_(config(), 1, &tokenizer_, nullptr, nullptr),
        intake_(scheduler_, &tokenizer_, std::nullopt, limits(tokenizer_), nullptr),
        service_(intake_, v1::ServerInfo()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    stub_ = v1::Inference::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port_), grpc::InsecureChannelCredentials()));
  }
  ~InferenceServiceTest() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  static SchedulerConfig config() {
    SchedulerConfig c;
    c.max_running = 256;  // every stream runs at once: each one's events wake it
    return c;
  }
  static ServiceLimits limits(const runtime::Tokenizer& tokenizer) {
    ServiceLimits l;
    l.model_id = "tiny";
    l.vocab_size = tokenizer.vocab_size();
    l.max_context = 4096;
    l.max_tokens_limit = 4000;
    return l;
  }

  // Starts Generate(`prompt`, max_tokens); its events come through cq_ tagged with the call.
  void start(Call& call, std::int64_t max_tokens) {
    v1::GenerateRequest request;
    request.add_input_ids(5);
    request.add_input_ids(6);
    request.mutable_sampling()->set_max_tokens(static_cast<std::uint32_t>(max_tokens));
    call.reader = stub_->AsyncGenerate(&call.context, request, &cq_, &call);
  }

  // Handles one completion-queue event of a call: the start or a read asks for the next chunk; a failed read
  // asks for the status; the status ends the call. Returns false once the queue is shut down.
  bool pump_client(std::chrono::milliseconds timeout) {
    void* tag = nullptr;
    bool ok = false;
    const auto deadline = std::chrono::system_clock::now() + timeout;
    if (cq_.AsyncNext(&tag, &ok, deadline) != grpc::CompletionQueue::GOT_EVENT) return false;
    auto* marker = static_cast<char*>(tag);
    if (marker >= finish_tags_.data() && marker < finish_tags_.data() + finish_tags_.size()) {
      calls_[static_cast<std::size_t>(marker - finish_tags_.data())]->finished = true;
      return true;
    }
    Call& call = *static_cast<Call*>(tag);
    if (ok) {
      call.tokens += call.chunk.token_ids_size();
      call.chunk.Clear();
      call.reader->Read(&call.chunk, &call);
    } else {
      const auto index = static_cast<std::size_t>(
          std::find_if(calls_.begin(), calls_.end(), [&](const auto& c) { return c.get() == &call; }) -
          calls_.begin());
      call.reader->Finish(&call.status, &finish_tags_[index]);
    }
    return true;
  }

  // Runs one step in which every running sequence samples `token`; returns the sequences it started.
  std::size_t step(std::int32_t token) { return steps_.step(token).starts.size(); }

  runtime::Tokenizer tokenizer_;
  Scheduler scheduler_;
  SchedulerSteps steps_{scheduler_};
  RequestIntake intake_;
  InferenceService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Inference::Stub> stub_;
  grpc::CompletionQueue cq_;
  std::vector<std::unique_ptr<Call>> calls_;
  std::vector<char> finish_tags_;  // one distinct tag per call for its Finish
};

// The sync service held one handler thread per open stream (blocked in Request::next); the callback service
// holds none: 200 streams in flight at once leave the thread count where a single call left it.
TEST_F(InferenceServiceTest, TwoHundredOpenStreamsHoldNoThreadEach) {
  constexpr std::size_t kStreams = 200;
  constexpr std::int64_t kTokens = 8;
  finish_tags_.resize(kStreams + 1);
  const std::int32_t token = single_token(tokenizer_, "a");
  const auto run_until = [&](auto done) {
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    while (!done() && Clock::now() < deadline) {
      while (pump_client(std::chrono::milliseconds(0))) {
      }
      if (scheduler_.idle()) {
        scheduler_.wait_for_work(std::chrono::milliseconds(50));
        pump_client(std::chrono::milliseconds(1));
      } else {
        step(token);
      }
    }
    ASSERT_TRUE(done()) << "timed out";
  };
  // One call first: gRPC starts its threads lazily; this is the count a single stream leaves.
  calls_.push_back(std::make_unique<Call>());
  start(*calls_.back(), kTokens);
  run_until([&] { return calls_.back()->finished; });
  ASSERT_TRUE(calls_.back()->status.ok()) << calls_.back()->status.error_message();
  const int baseline = process_threads();

  for (std::size_t i = 0; i < kStreams; ++i) {
    calls_.push_back(std::make_unique<Call>());
    start(*calls_.back(), kTokens);
  }
  // Every stream admitted and generating: each holds whatever it holds now.
  std::size_t started = 0;
  int peak = baseline;
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (started < kStreams && Clock::now() < deadline) {
    while (pump_client(std::chrono::milliseconds(0))) {
    }
    if (scheduler_.idle()) {
      scheduler_.wait_for_work(std::chrono::milliseconds(50));
    } else {
      started += step(token);
    }
    peak = std::max(peak, process_threads());
  }
  ASSERT_EQ(started, kStreams);
  run_until([&] {
    peak = std::max(peak, process_threads());
    return std::ranges::all_of(calls_, [](const auto& c) { return c->finished; });
  });
  for (const auto& call : calls_) {
    EXPECT_TRUE(call->status.ok()) << call->status.error_message();
    EXPECT_EQ(call->tokens, kTokens);
  }
  std::printf("200 concurrent gRPC streams: process threads %d after one call, %d at most\n", baseline, peak);
  EXPECT_LE(peak, baseline + 16);
}

// A client that cancels its stream cancels the request at once: the scheduler frees it at its next step.
TEST_F(InferenceServiceTest, ACancelledStreamCancelsItsRequest) {
  finish_tags_.resize(1);
  calls_.push_back(std::make_unique<Call>());
  Call& call = *calls_.back();
  constexpr std::int64_t kTokens = 4000;
  start(call, kTokens);
  const std::int32_t token = single_token(tokenizer_, "a");
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (call.tokens == 0 && Clock::now() < deadline) {
    pump_client(std::chrono::milliseconds(0));
    if (scheduler_.idle()) {
      scheduler_.wait_for_work(std::chrono::milliseconds(50));
    } else {
      step(token);
    }
  }
  ASSERT_GT(call.tokens, 0);
  call.context.TryCancel();
  // Steps go on, a token each, until the scheduler has freed the request; paced, so that the request would
  // need 20 s to run to its max_tokens.
  std::int64_t steps = 0;
  while (!scheduler_.idle() && Clock::now() < deadline) {
    step(token);
    ++steps;
    pump_client(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(scheduler_.idle());
  EXPECT_LT(steps, kTokens - 1) << "the request ran to its max_tokens";
  while (!call.finished && Clock::now() < deadline) pump_client(std::chrono::milliseconds(100));
  EXPECT_EQ(call.status.error_code(), grpc::StatusCode::CANCELLED);
}

// A refusal answers at once with its status and field, and nothing reaches the scheduler.
TEST_F(InferenceServiceTest, ARefusedRequestGetsItsStatus) {
  v1::GenerateRequest request;
  request.add_input_ids(-1);
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, request);
  v1::GenerateChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "input_ids[0]: -1 is outside the vocabulary [0, " +
                                        std::to_string(tokenizer_.vocab_size()) + ")");
  EXPECT_TRUE(scheduler_.idle());
}

// The sampling controls' bad values are refused naming the field as gRPC spells it (sampling.<field>).
TEST_F(InferenceServiceTest, BadSamplingControlsAreRefusedNamingTheField) {
  const std::vector<std::pair<std::function<void(v1::SamplingOptions&)>, std::string>> cases = {
      {[](v1::SamplingOptions& s) { s.set_presence_penalty(2.5F); }, "sampling.presence_penalty"},
      {[](v1::SamplingOptions& s) { s.set_frequency_penalty(-3.0F); }, "sampling.frequency_penalty"},
      {[](v1::SamplingOptions& s) { s.set_repetition_penalty(0.0F); }, "sampling.repetition_penalty"},
      {[](v1::SamplingOptions& s) { s.set_min_p(1.01F); }, "sampling.min_p"},
      {[](v1::SamplingOptions& s) { s.set_min_tokens(9); }, "sampling.min_tokens"},
      {[](v1::SamplingOptions& s) { (*s.mutable_logit_bias())[-1] = 1.0F; }, "sampling.logit_bias"},
      {[](v1::SamplingOptions& s) { (*s.mutable_logit_bias())[3] = 100.5F; }, "sampling.logit_bias"},
      {[](v1::SamplingOptions& s) { (*s.mutable_logit_bias())[1 << 30] = 1.0F; }, "sampling.logit_bias"},
  };
  for (const auto& [change, field] : cases) {
    v1::GenerateRequest request;
    request.add_input_ids(5);
    request.mutable_sampling()->set_max_tokens(8);
    change(*request.mutable_sampling());
    grpc::ClientContext context;
    auto reader = stub_->Generate(&context, request);
    v1::GenerateChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_EQ(status.error_message().rfind(field + ": ", 0), 0U) << status.error_message();
  }
  EXPECT_TRUE(scheduler_.idle());
}

}  // namespace
}  // namespace capserve::server
