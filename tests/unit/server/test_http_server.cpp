// The hardened HTTP server over raw sockets: exact routes, GET/HEAD (and POST where a route takes it), a
// clean 4xx for every malformed or hostile request (the civetweb exposer it replaces died on any 404/405),
// idle and slowloris sockets that neither block other clients nor stay open past the read deadline, a
// connection limit, bind errors naming the address; responses from a Producer, whole or streamed in chunks,
// many at once on one I/O thread, and a client that leaves abandons its producer at once. Hostile clients of
// issue 24: request framing other than a final chunked refused (no smuggling), 100 Continue on an accepted
// head only, unframed HTTP/1.0 streams, a stream cancelled once its client stops reading, a per-address
// connection cap, POST handlers on a bounded worker pool whose stop is requested when the client leaves or
// the server drains.
#include "server/http/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace capserve::server::http {
namespace {

using namespace std::chrono_literals;
using Routes = std::map<std::string, Route, std::less<>>;

// A connected client socket to 127.0.0.1:port; closed on destruction.
class Client {
 public:
  // `from`: the local address to connect from (another loopback address is another client address);
  // `receive_buffer`: a small one makes a client that does not read stall the server's writes soon.
  explicit Client(int port, const char* from = nullptr, int receive_buffer = 0)
      : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    if (fd_ < 0) throw std::runtime_error("socket() failed");
    timeval tv{5, 0};  // no test waits longer than this for an answer
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (receive_buffer > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
    if (from != nullptr) {
      sockaddr_in local{};
      local.sin_family = AF_INET;
      ::inet_pton(AF_INET, from, &local.sin_addr);
      if (::bind(fd_, reinterpret_cast<const sockaddr*>(&local), sizeof local) != 0) {
        ::close(fd_);
        throw std::runtime_error(std::string("cannot bind to ") + from);
      }
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(fd_);
      throw std::runtime_error("cannot connect to 127.0.0.1:" + std::to_string(port));
    }
  }
  ~Client() { ::close(fd_); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // False when the server has closed the connection.
  bool send(const std::string& bytes) {
    for (std::size_t sent = 0; sent < bytes.size();) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    return true;
  }
  // Everything until the server closes the connection (or 5 s pass).
  std::string read_all() {
    std::string out;
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return out;
      out.append(buf, static_cast<std::size_t>(n));
    }
  }
  // A response head (and whatever came with it) once it is complete, or "" when `wait` passes first; the
  // connection stays open and a later call goes on from what arrived.
  std::string read_head(std::chrono::milliseconds wait) {
    char buf[4096];
    const auto until = std::chrono::steady_clock::now() + wait;
    while (head_.find("\r\n\r\n") == std::string::npos && std::chrono::steady_clock::now() < until) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        head_.append(buf, static_cast<std::size_t>(n));
      } else if (n == 0) {
        break;
      } else {
        std::this_thread::sleep_for(2ms);
      }
    }
    return head_.find("\r\n\r\n") == std::string::npos ? "" : std::exchange(head_, {});
  }
  // One answer on a kept-alive connection: the head and Content-Length bytes of body.
  std::string read_response() {
    std::string out;
    char c = 0;
    while (out.find("\r\n\r\n") == std::string::npos && ::recv(fd_, &c, 1, 0) == 1) out += c;
    const auto at = out.find("Content-Length: ");
    std::size_t length = at == std::string::npos ? 0 : std::stoul(out.substr(at + 16));
    while (length > 0 && ::recv(fd_, &c, 1, 0) == 1) {
      out += c;
      --length;
    }
    return out;
  }
  // Whether the server closed the connection (a read returns end of stream) within `wait`.
  bool closed_within(std::chrono::milliseconds wait) {
    timeval tv{static_cast<time_t>(wait.count() / 1000),
               static_cast<suseconds_t>((wait.count() % 1000) * 1000)};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[256];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }

 private:
  int fd_;
  std::string head_;  // read_head's bytes so far
};

int status_of(const std::string& response) {
  if (response.rfind("HTTP/1.", 0) != 0 || response.size() < 12) return -1;
  return std::stoi(response.substr(9, 3));
}

std::string body_of(const std::string& response) {
  const auto at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

std::string exchange(int port, const std::string& request) {
  Client c(port);
  c.send(request);
  return c.read_all();
}

class HttpServerTest : public ::testing::Test {
 protected:
  static Options options() {
    Options o;
    o.host = "127.0.0.1";
    o.read_timeout = 500ms;
    o.max_header_bytes = 1024;
    o.max_body_bytes = 1024;
    return o;
  }
  int scrapes_ = 0;
  Server server_{options(),
                 {{"/metrics",
                   [this] {
                     ++scrapes_;
                     return Response{200, "text/plain; version=0.0.4", "capserve_up 1\n"};
                   }},
                  {"/boom", []() -> Response { throw std::runtime_error("handler failed"); }}}};
};

TEST_F(HttpServerTest, ServesGetAndHeadOfAnExactPath) {
  const std::string get =
      exchange(server_.port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(get), 200) << get;
  EXPECT_EQ(body_of(get), "capserve_up 1\n");
  EXPECT_NE(get.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << get;
  // A query string does not change the path (Prometheus may add one).
  EXPECT_EQ(status_of(exchange(server_.port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n")), 200);
  const std::string head = exchange(server_.port(), "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(status_of(head), 200) << head;
  EXPECT_NE(head.find("Content-Length: 14"), std::string::npos) << head;
  EXPECT_EQ(body_of(head), "");
}

// A key ending in '/' serves the paths under it (the handler sees which), the longest such key winning; an
// exact route still wins, and the bare prefix without a rest is not under it.
TEST(HttpServerRoutes, SubtreeRoutesServeThePathsUnderThem) {
  Options o;
  o.host = "127.0.0.1";
  const auto echo_path = [](std::string tag) {
    return Route(Method::get, [tag](const IncomingRequest& in) {
      return Response{200, "text/plain", tag + ":" + std::string(in.path)};
    });
  };
  Server server(o, {{"/v1/models/", echo_path("models")},
                    {"/v1/models/special/", echo_path("special")},
                    {"/v1/models/exact", echo_path("exact")}});
  const auto get = [&](const std::string& target) {
    return exchange(server.port(), "GET " + target + " HTTP/1.0\r\n\r\n");
  };
  EXPECT_EQ(body_of(get("/v1/models/org/name?x=1")), "models:/v1/models/org/name");
  EXPECT_EQ(body_of(get("/v1/models/special/a")), "special:/v1/models/special/a");
  EXPECT_EQ(body_of(get("/v1/models/exact")), "exact:/v1/models/exact");
  EXPECT_EQ(body_of(get("/v1/models/")), "models:/v1/models/");  // the key itself is an exact path
  EXPECT_EQ(status_of(get("/v1/models")), 404);
  EXPECT_EQ(status_of(get("/v1/modelsx")), 404);
}

TEST_F(HttpServerTest, KeepAliveServesSeveralAndPipelinedRequests) {
  Client c(server_.port());
  ASSERT_TRUE(c.send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(status_of(c.read_response()), 200);
  ASSERT_TRUE(c.send("GET /nope HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(status_of(c.read_response()), 404);
  const std::string third = c.read_response();
  EXPECT_EQ(status_of(third), 200);
  EXPECT_EQ(body_of(third), "capserve_up 1\n");
}

// Every request that crashed, confused or bypassed the old exposer: each gets its status, and the server then
// still serves /metrics.
TEST_F(HttpServerTest, EveryHostileRequestGetsACleanAnswer) {
  struct Case {
    std::string request;
    int status;  // -1: the connection is closed without an answer
  };
  const std::string big_header(2000, 'a');
  const std::string big_body(2000, 'b');
  const std::vector<Case> cases{
      {"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404},
      {"GET /favicon.ico HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404},
      {"GET /healthz HTTP/1.0\r\n\r\n", 404},
      {"GET /../../etc/passwd HTTP/1.0\r\n\r\n", 404},
      {"GET /metrics/ HTTP/1.0\r\n\r\n", 404},
      {"GET /metricsX HTTP/1.0\r\n\r\n", 404},
      {"GET /%6Detrics HTTP/1.0\r\n\r\n", 404},
      {"GET http://evil/metrics HTTP/1.0\r\n\r\n", 404},
      {"OPTIONS * HTTP/1.0\r\n\r\n", 404},
      {"POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc", 405},
      {"PUT /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", 405},
      {"DELETE /metrics HTTP/1.0\r\n\r\n", 405},
      {"BREW /metrics HTTP/1.0\r\n\r\n", 405},
      {"GET /boom HTTP/1.0\r\n\r\n", 500},
      {"GET /metrics HTTP/1.0\r\nX-Big: " + big_header + "\r\n\r\n", 431},
      {"POST /metrics HTTP/1.0\r\nContent-Length: 2000\r\n\r\n" + big_body, 413},
      {"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400},
      {"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400},
      // Refused on its head: the route takes no POST (a malformed chunked body: HttpHardeningTest).
      {"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 405},
      {"GET /metrics HTTP/1.1\r\nBad Header Name: x\r\n\r\n", 400},
      {"GET /metrics HTTP/x.y\r\n\r\n", 400},
      {"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS client hello", 400},
      {std::string("G\0T /metrics HTTP/1.0\r\n\r\n", 25), 400},
      {"\r\n\r\n\r\n", 400},
      {"GET /metrics\r\n\r\n", 400},
      {"GET /metrics HTTP/1.1\r\nHost: x\r\n", -1},  // cut short: closed at the read deadline
  };
  for (const Case& c : cases) {
    const std::string response = exchange(server_.port(), c.request);
    EXPECT_EQ(status_of(response), c.status)
        << "request: " << c.request.substr(0, 60) << "\nanswer: " << response;
  }
  const std::string after = exchange(server_.port(), "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(status_of(after), 200) << after;
  const std::string allowed = exchange(server_.port(), "POST /metrics HTTP/1.0\r\n\r\n");
  EXPECT_NE(allowed.find("Allow: GET, HEAD"), std::string::npos) << allowed;
}

TEST_F(HttpServerTest, IdleAndSlowlorisSocketsBlockNobodyAndAreCutAtTheDeadline) {
  Client idle1(server_.port());
  Client idle2(server_.port());
  Client slow(server_.port());
  ASSERT_TRUE(slow.send("GET /metrics HTTP/1.1\r\n"));
  const auto start = std::chrono::steady_clock::now();
  const std::string fast = exchange(server_.port(), "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(status_of(fast), 200) << fast;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 200ms);
  // The slow client keeps sending header lines more slowly than the deadline allows for the whole request.
  std::this_thread::sleep_for(200ms);
  slow.send("X-A: 1\r\n");
  std::this_thread::sleep_for(200ms);
  slow.send("X-B: 2\r\n");
  EXPECT_TRUE(slow.closed_within(1000ms));
  EXPECT_TRUE(idle1.closed_within(1000ms));
  EXPECT_TRUE(idle2.closed_within(1000ms));
}

TEST(HttpServerLimits, ConnectionsBeyondTheLimitAreClosed) {
  Options o;
  o.host = "127.0.0.1";
  o.max_connections = 2;
  o.max_connections_per_peer = 0;  // both from one address here
  Server server(o, {{"/metrics", [] { return Response{200, "text/plain", "ok\n"}; }}});
  Client a(server.port());
  Client b(server.port());
  for (int i = 0; i < 100 && server.open_connections() < 2; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(server.open_connections(), 2U);
  Client c(server.port());
  EXPECT_TRUE(c.closed_within(2000ms));
  // Room again once one of the first two leaves.
  ASSERT_TRUE(a.send("GET /metrics HTTP/1.0\r\n\r\n"));
  EXPECT_EQ(status_of(a.read_all()), 200);
  for (int i = 0; i < 100 && server.open_connections() > 1; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(status_of(exchange(server.port(), "GET /metrics HTTP/1.0\r\n\r\n")), 200);
}

TEST(HttpServerBind, AddressInUseThrowsNamingTheAddress) {
  Options o;
  o.host = "127.0.0.1";
  Server first(o, {});
  o.port = first.port();
  const std::string address = "127.0.0.1:" + std::to_string(first.port());
  try {
    Server second(o, {});
    FAIL() << "binding " << address << " twice did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(address), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
}

TEST(HttpServerBind, RejectsBadPortsAndHosts) {
  Options o;
  o.port = 70000;
  EXPECT_THROW(Server(o, {}), std::invalid_argument);
  o.port = 0;
  o.host = "no.such.host.invalid";
  EXPECT_THROW(Server(o, {}), std::runtime_error);
  o.host = "[::1]";  // bracketed IPv6 literal, as on the command line
  try {
    Server v6(o, {});
    EXPECT_GT(v6.port(), 0);
  } catch (const std::runtime_error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
}

// A producer the test feeds by hand: text appended and the end marked from the test thread.
class FedProducer final : public Producer {
 public:
  explicit FedProducer(unsigned status = 200) : status_(status) {}
  void start(std::function<void()> wake) override {
    std::lock_guard lock(mutex_);
    wake_ = std::move(wake);
    started_ = true;
  }
  bool poll(std::string& out) override {
    std::lock_guard lock(mutex_);
    out += std::exchange(ready_, {});
    return done_;
  }
  [[nodiscard]] unsigned status() const override { return status_; }
  void abandon() override { abandoned_.store(true); }

  void feed(const std::string& text, bool done) {
    std::function<void()> wake;
    {
      std::lock_guard lock(mutex_);
      ready_ += text;
      done_ = done;
      wake = wake_;
    }
    if (wake) wake();
  }
  bool started() {
    std::lock_guard lock(mutex_);
    return started_;
  }
  std::atomic<bool> abandoned_{false};

 private:
  unsigned status_;
  std::mutex mutex_;
  std::function<void()> wake_;
  std::string ready_;
  bool done_ = false;
  bool started_ = false;
};

class HttpProducerTest : public ::testing::Test {
 protected:
  static Options options() {
    Options o;
    o.host = "127.0.0.1";
    o.io_threads = 1;  // every stream on one thread: none holds it
    o.read_timeout = 500ms;
    o.max_connections_per_peer = 255;  // hundreds of streams from this one address
    return o;
  }
  std::shared_ptr<FedProducer> next(unsigned status = 200) {
    std::lock_guard lock(mutex_);
    producers_.push_back(std::make_shared<FedProducer>(status));
    return producers_.back();
  }
  std::shared_ptr<FedProducer> at(std::size_t i) {
    for (int k = 0; k < 300; ++k) {
      {
        std::lock_guard lock(mutex_);
        if (producers_.size() > i && producers_[i]->started()) return producers_[i];
      }
      std::this_thread::sleep_for(10ms);
    }
    throw std::runtime_error("producer " + std::to_string(i) + " never started");
  }

  std::mutex mutex_;
  std::vector<std::shared_ptr<FedProducer>> producers_;
  Server server_{
      options(),
      {{"/stream", Route(Method::post,
                         [this](const IncomingRequest& in) {
                           Response r{200, "text/event-stream", {}, {{"X-Echo", std::string(in.body)}}};
                           r.producer = next();
                           r.stream = true;
                           return r;
                         })},
       {"/whole", Route(Method::post, [this](const IncomingRequest&) {
          Response r{200, "application/json", {}};
          r.producer = next(201);
          return r;
        })}}};
};

const std::string kStreamRequest = "POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi";

TEST_F(HttpProducerTest, StreamsChunksAsTheyComeThenEnds) {
  Client c(server_.port());
  ASSERT_TRUE(c.send(kStreamRequest));
  const auto p = at(0);
  p->feed("data: 1\n\n", false);
  p->feed("data: 2\n\n", true);
  const std::string response = c.read_all();
  EXPECT_EQ(status_of(response), 200) << response;
  EXPECT_NE(response.find("Transfer-Encoding: chunked"), std::string::npos) << response;
  EXPECT_NE(response.find("X-Echo: hi"), std::string::npos) << response;
  EXPECT_NE(response.find("Content-Type: text/event-stream"), std::string::npos) << response;
  const std::string body = body_of(response);
  // Chunk framing: the two events (in one or two chunks), then the last, empty chunk.
  EXPECT_NE(body.find("data: 1\n\n"), std::string::npos) << body;
  EXPECT_NE(body.find("data: 2\n\n"), std::string::npos) << body;
  EXPECT_TRUE(body.ends_with("\r\n0\r\n\r\n")) << body;
  EXPECT_FALSE(p->abandoned_.load());
}

TEST_F(HttpProducerTest, AWholeResponseWaitsForItsProducerAndTakesItsStatus) {
  Client c(server_.port());
  ASSERT_TRUE(c.send("POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"));
  const auto p = at(0);
  p->feed("{\"a\":", false);
  p->feed("1}", true);
  const std::string response = c.read_all();
  EXPECT_EQ(status_of(response), 201) << response;
  EXPECT_EQ(body_of(response), "{\"a\":1}");
  EXPECT_NE(response.find("Content-Length: 7"), std::string::npos) << response;
}

TEST_F(HttpProducerTest, AClientThatLeavesAbandonsItsProducerAtOnce) {
  {
    Client c(server_.port());
    ASSERT_TRUE(c.send(kStreamRequest));
    at(0)->feed("data: 1\n\n", false);
  }
  const auto p = at(0);
  for (int i = 0; i < 200 && !p->abandoned_.load(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(p->abandoned_.load());
  // A stream waits longer than the read deadline without being cut: only a client that leaves ends it.
  Client waiting(server_.port());
  ASSERT_TRUE(waiting.send(kStreamRequest));
  std::this_thread::sleep_for(800ms);
  const auto q = at(1);
  EXPECT_FALSE(q->abandoned_.load());
  q->feed("data: late\n\n", true);
  EXPECT_NE(waiting.read_all().find("data: late"), std::string::npos);
}

TEST_F(HttpProducerTest, HundredsOfOpenStreamsShareOneThread) {
  constexpr int kStreams = 200;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < kStreams; ++i) {
    clients.push_back(std::make_unique<Client>(server_.port()));
    ASSERT_TRUE(clients.back()->send(kStreamRequest));
  }
  for (int i = 0; i < kStreams; ++i)
    at(static_cast<std::size_t>(i))->feed("data: " + std::to_string(i) + "\n\n", true);
  for (int i = 0; i < kStreams; ++i) {
    const std::string response = clients[static_cast<std::size_t>(i)]->read_all();
    EXPECT_EQ(status_of(response), 200);
    EXPECT_NE(response.find("data: "), std::string::npos);
  }
}

// HTTP/1.0 has no chunked framing: the stream is the bare body, ended by closing the connection.
TEST_F(HttpProducerTest, AnHttp10StreamIsUnframedAndEndsWithTheConnection) {
  Client c(server_.port());
  ASSERT_TRUE(c.send("POST /stream HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi"));
  const auto p = at(0);
  p->feed("data: 1\n\n", false);
  p->feed("data: 2\n\n", true);
  const std::string response = c.read_all();
  EXPECT_EQ(status_of(response), 200) << response;
  EXPECT_EQ(response.find("Transfer-Encoding"), std::string::npos) << response;
  EXPECT_EQ(body_of(response), "data: 1\n\ndata: 2\n\n") << response;
}

// A client that stops reading a stream: once its unsent output passes the bound (1 MiB by default), the
// stream is cancelled, long before the write deadline (a minute here) would cut it.
TEST(HttpStalledStream, AClientThatStopsReadingIsCancelledByItsBacklog) {
  Options o;
  o.host = "127.0.0.1";
  o.write_timeout = 60s;
  auto producer = std::make_shared<FedProducer>();
  Server server(o, {{"/stream", Route(Method::post, [producer](const IncomingRequest&) {
                       Response r{200, "text/event-stream", {}};
                       r.producer = producer;
                       r.stream = true;
                       return r;
                     })}});
  Client stalled(server.port(), nullptr, 4096);
  ASSERT_TRUE(stalled.send(kStreamRequest));
  for (int i = 0; i < 300 && !producer->started(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(producer->started());
  const std::string event = "data: " + std::string(64 * 1024, 'x') + "\n\n";
  const auto start = std::chrono::steady_clock::now();
  // Up to 64 MiB, fed as the server takes it; the client never reads.
  for (int i = 0; i < 1024 && !producer->abandoned_.load(); ++i) {
    producer->feed(event, false);
    std::this_thread::sleep_for(2ms);
  }
  for (int i = 0; i < 500 && !producer->abandoned_.load(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(producer->abandoned_.load());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
}

TEST_F(HttpProducerTest, WrongMethodsAndErrorsUseTheConfiguredShape) {
  EXPECT_EQ(status_of(exchange(server_.port(), "GET /stream HTTP/1.0\r\n\r\n")), 405);
  const std::string allowed = exchange(server_.port(), "GET /stream HTTP/1.0\r\n\r\n");
  EXPECT_NE(allowed.find("Allow: POST"), std::string::npos) << allowed;
  Options o;
  o.host = "127.0.0.1";
  o.error_response = [](unsigned status, std::string_view message) {
    return Response{status, "application/json", "{\"error\":\"" + std::string(message) + "\"}"};
  };
  Server json_errors(o, {});
  const std::string missing = exchange(json_errors.port(), "GET /x HTTP/1.0\r\n\r\n");
  EXPECT_EQ(status_of(missing), 404);
  EXPECT_EQ(body_of(missing), "{\"error\":\"not found\"}");
}

// Routes for the hostile-client tests: /metrics (GET), /echo (POST, answers its body) and /slow (POST, holds
// its worker until released).
class HttpHardeningTest : public ::testing::Test {
 protected:
  static Options options() {
    Options o;
    o.host = "127.0.0.1";
    o.io_threads = 1;
    o.read_timeout = 2000ms;
    o.max_body_bytes = 1024;
    return o;
  }
  ~HttpHardeningTest() override { release_.store(true); }

  std::atomic<bool> release_{false};
  std::atomic<int> slow_started_{0};
  Server server_{options(),
                 {{"/metrics",
                   [] {
                     return Response{200, "text/plain", "ok\n"};
                   }},
                  {"/echo", Route(Method::post,
                                  [](const IncomingRequest& in) {
                                    return Response{200, "text/plain", std::string(in.body)};
                                  })},
                  {"/slow", Route(Method::post, [this](const IncomingRequest&) {
                     ++slow_started_;
                     while (!release_.load()) std::this_thread::sleep_for(5ms);
                     return Response{200, "text/plain", "slow\n"};
                   })}}};
};

int count_answers(const std::string& bytes) {
  int n = 0;
  for (std::size_t at = bytes.find("HTTP/1."); at != std::string::npos; at = bytes.find("HTTP/1.", at + 1))
    ++n;
  return n;
}

// RFC 7230 §3.3.3: a Transfer-Encoding other than a final chunked alone cannot frame the body; taking it as
// no body would parse the body as the next request (here a smuggled GET). Each gets one refusal and a close.
TEST_F(HttpHardeningTest, TransferEncodingOtherThanChunkedIsRefusedAndNothingIsSmuggled) {
  const std::string smuggled = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  for (const std::string te : {"xchunked", "identity", "gzip", "chunked, identity",
                               "chunked\r\nTransfer-Encoding: "
                               "identity"}) {
    const std::string response = exchange(
        server_.port(), "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + te + "\r\n\r\n" + smuggled);
    EXPECT_EQ(status_of(response), 400) << te << "\n" << response;
    EXPECT_EQ(count_answers(response), 1) << te << "\n" << response;
  }
  // Content codings are not decoded: refused rather than taken as the body.
  const std::string gzip = exchange(
      server_.port(),
      "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n");
  EXPECT_EQ(status_of(gzip), 501) << gzip;
  EXPECT_EQ(count_answers(gzip), 1) << gzip;
  const std::string both =
      exchange(server_.port(),
               "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: "
               "chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n" +
                   smuggled);
  EXPECT_EQ(status_of(both), 400) << both;
  EXPECT_EQ(count_answers(both), 1) << both;
  const std::string malformed =
      exchange(server_.port(), "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
  EXPECT_EQ(status_of(malformed), 400) << malformed;
  const std::string chunked =
      exchange(server_.port(),
               "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n");
  EXPECT_EQ(status_of(chunked), 200) << chunked;
  EXPECT_EQ(body_of(chunked), "abc");
}

// curl sends `Expect: 100-continue` before a body over 1 KiB and waits a second for the interim answer.
TEST_F(HttpHardeningTest, ExpectContinueIsAnsweredBeforeTheBodyOnlyWhenTheHeadIsAccepted) {
  Client c(server_.port());
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"));
  const std::string interim = c.read_head(5000ms);  // returns as soon as the head is in
  EXPECT_EQ(interim, "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(c.send("abc"));
  const std::string final_answer = c.read_all();
  EXPECT_EQ(status_of(final_answer), 200) << final_answer;
  EXPECT_EQ(body_of(final_answer), "abc");
  // A head refused as it stands gets its refusal and no 100.
  const std::string too_big =
      exchange(server_.port(),
               "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n");
  EXPECT_EQ(status_of(too_big), 413) << too_big;
  EXPECT_EQ(too_big.find("100 Continue"), std::string::npos) << too_big;
  const std::string other = exchange(
      server_.port(), "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: coffee\r\n\r\nabc");
  EXPECT_EQ(status_of(other), 417) << other;
}

// POST handlers run on workers: two that take their time hold no I/O thread (there is one), so GET routes
// answer at once meanwhile.
TEST_F(HttpHardeningTest, SlowPostHandlersDoNotHoldUpGetRoutes) {
  Client a(server_.port());
  Client b(server_.port());
  ASSERT_TRUE(a.send("POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"));
  ASSERT_TRUE(b.send("POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"));
  for (int i = 0; i < 500 && slow_started_.load() < 2; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(slow_started_.load(), 2);
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    const std::string metrics = exchange(server_.port(), "GET /metrics HTTP/1.0\r\n\r\n");
    EXPECT_EQ(status_of(metrics), 200) << metrics;
    EXPECT_LT(std::chrono::steady_clock::now() - start, 500ms);
  }
  release_.store(true);
  EXPECT_EQ(body_of(a.read_all()), "slow\n");
  EXPECT_EQ(body_of(b.read_all()), "slow\n");
}

TEST(HttpServerLimits, ConnectionsFromOneAddressBeyondItsCapAreClosed) {
  Options o;
  o.host = "127.0.0.1";
  o.max_connections = 8;
  o.max_connections_per_peer = 2;
  Server server(o, {{"/metrics", [] { return Response{200, "text/plain", "ok\n"}; }}});
  Client a(server.port());
  Client b(server.port());
  for (int i = 0; i < 100 && server.open_connections() < 2; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(server.open_connections(), 2U);
  Client c(server.port());
  EXPECT_TRUE(c.closed_within(2000ms));
  // Another address still gets in.
  Client other(server.port(), "127.0.0.2");
  ASSERT_TRUE(other.send("GET /metrics HTTP/1.0\r\n\r\n"));
  EXPECT_EQ(status_of(other.read_all()), 200);
  // One address cannot be allowed every connection.
  o.max_connections_per_peer = 8;
  EXPECT_THROW(Server(o, {}), std::invalid_argument);
}

// The worker pool's queue is bounded: past it a POST is refused at once. A handler's stop is requested when
// its client leaves and when the server drains (cancel_pending), which also refuses new POSTs.
TEST(HttpWorkers, AFullQueueRefusesAtOnceAndStopReachesTheHandler) {
  Options o;
  o.host = "127.0.0.1";
  o.workers = 1;
  o.max_queued_requests = 1;
  std::atomic<int> started{0}, stopped{0};
  Server server(o, {{"/wait", Route(Method::post, [&](const IncomingRequest& in) {
                       ++started;
                       while (!in.stop.stop_requested()) std::this_thread::sleep_for(2ms);
                       ++stopped;
                       return Response{200, "text/plain", "stopped\n"};
                     })}});
  const std::string request =
      "POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
  auto running = std::make_unique<Client>(server.port());
  ASSERT_TRUE(running->send(request));
  for (int i = 0; i < 500 && started.load() < 1; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(started.load(), 1);
  // Two more: one waits in the queue, the other finds it full and is refused at once.
  Client first(server.port());
  Client second(server.port());
  ASSERT_TRUE(first.send(request));
  ASSERT_TRUE(second.send(request));
  std::string refused;
  Client* queued = nullptr;
  const auto start = std::chrono::steady_clock::now();
  while (refused.empty() && std::chrono::steady_clock::now() - start < 5s) {
    if (refused = first.read_head(5ms); !refused.empty()) {
      queued = &second;
    } else if (refused = second.read_head(5ms); !refused.empty()) {
      queued = &first;
    }
  }
  EXPECT_EQ(status_of(refused), 503) << refused;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  ASSERT_NE(queued, nullptr);
  // The running handler's client leaves: its stop is requested; the queued one then runs.
  running.reset();
  for (int i = 0; i < 500 && (stopped.load() < 1 || started.load() < 2); ++i)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(stopped.load(), 1);
  EXPECT_EQ(started.load(), 2);
  // Draining stops it too, and refuses new POSTs.
  server.cancel_pending();
  EXPECT_EQ(body_of(queued->read_all()), "stopped\n");
  const std::string late = exchange(server.port(), request);
  EXPECT_EQ(status_of(late), 503) << late;
}

// Stopping the server does not wait for a handler that runs until stopped (a SIGTERM during a render).
TEST(HttpWorkers, StoppingTheServerStopsARunningHandler) {
  Options o;
  o.host = "127.0.0.1";
  std::atomic<bool> started{false};
  auto server =
      std::make_unique<Server>(o, Routes{{"/wait", Route(Method::post, [&](const IncomingRequest& in) {
                                            started.store(true);
                                            while (!in.stop.stop_requested())
                                              std::this_thread::sleep_for(2ms);
                                            return Response{200, "text/plain", ""};
                                          })}});
  Client c(server->port());
  ASSERT_TRUE(c.send("POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"));
  for (int i = 0; i < 500 && !started.load(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(started.load());
  const auto start = std::chrono::steady_clock::now();
  server.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

// An admission check (the API key) refuses on the head: no 100 Continue, no body read.
TEST(HttpAdmission, ARefusedHeadGetsNoContinue) {
  Options o;
  o.host = "127.0.0.1";
  Route echo(Method::post, [](const IncomingRequest& in) {
    return Response{200, "text/plain", std::string(in.body)};
  });
  echo.admit = [](const IncomingRequest& in) -> std::optional<Response> {
    if (in.header("authorization") == "Bearer k") return std::nullopt;
    return Response{401, "text/plain", "no key\n"};
  };
  Server server(o, {{"/echo", echo}});
  Client c(server.port());
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"));
  const std::string refused = c.read_all();
  EXPECT_EQ(status_of(refused), 401) << refused;
  EXPECT_EQ(refused.find("100 Continue"), std::string::npos) << refused;
  const std::string allowed =
      exchange(server.port(),
               "POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Length: 3\r\n\r\nabc");
  EXPECT_EQ(body_of(allowed), "abc") << allowed;
}

}  // namespace
}  // namespace capserve::server::http
