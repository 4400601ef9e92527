#pragma once
// A small hardened HTTP/1.1 server for rank 0's HTTP endpoints (`/metrics`, the OpenAI API), on Boost.Beast
// over Asio. It replaces prometheus-cpp's civetweb exposer, which died with SIGSEGV on any 404/405 answer
// (Debian civetweb 1.15) and let two idle or slowloris sockets block every scrape. Here each connection is an
// asynchronous state machine on a fixed number of I/O threads, so an idle socket holds no thread; a request
// must arrive whole within a deadline, headers and bodies are bounded, paths match exactly (the query string
// aside) or lie under a subtree route, and anything else gets a clean 4xx answer. A response that waits on
// the engine (a completion, whole or streamed as Server-Sent Events) is a Producer: it wakes its connection
// when it has news instead of holding a thread, so hundreds of open streams need no more than the fixed I/O
// threads.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "server/security/tls_credentials.h"

namespace capserve::server::http {

// The body of a response that is not ready when its handler returns. All calls but wake's come on the
// connection's I/O thread, one at a time.
class Producer {
 public:
  virtual ~Producer() = default;
  // Once, first: `wake` (callable from any thread, cheap, any number of times) asks for a poll soon.
  virtual void start(std::function<void()> wake) = 0;
  // Appends what is ready to `out`; true once the body is complete (then it is not called again).
  virtual bool poll(std::string& out) = 0;
  // For a whole (not streamed) response, once complete: the status to answer with.
  [[nodiscard]] virtual unsigned status() const { return 200; }
  // The client went away (or was cut off) before the body was complete.
  virtual void abandon() = 0;
};

struct Response {
  unsigned status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers = {};
  // When set, the body comes from it; `body` is ignored. Streamed: the head (with `status`) goes out at once
  // and the body as it comes (chunked); else the whole answer once complete, with the producer's status.
  std::shared_ptr<Producer> producer = {};
  bool stream = false;
};

// What a handler sees of its request.
struct IncomingRequest {
  std::string_view body;
  std::string peer;  // the client's address as gRPC names it: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"
  std::function<std::string_view(std::string_view name)> header;  // empty when absent
  // Requested when the client has gone or the server drains or stops: long work should end early.
  std::stop_token stop = {};
  std::string_view path = {};  // the target without its query string: what a subtree route matched
};

enum class Method { get, post };

// One path's handler. GET routes also answer HEAD (the same head, no body). GET handlers run on an I/O
// thread: keep them short. POST handlers (parsing, validation, template rendering, tokenization: work that
// can take seconds) run on the worker pool, so that they never hold up the I/O threads and the GET routes on
// them; a POST's answer closes its connection. A response that waits on the engine is a Producer. An
// exception becomes a 500 answer.
struct Route {
  template <typename F>
  requires std::is_invocable_r_v<Response, F> Route(F get)
      : method(Method::get), handler([get = std::move(get)](const IncomingRequest&) { return get(); }) {}
  Route(Method m, std::function<Response(const IncomingRequest&)> h) : method(m), handler(std::move(h)) {}

  Method method;
  std::function<Response(const IncomingRequest&)> handler;
  // Checks the request's head (body empty) on the I/O thread before its body is read (e.g. the API key): an
  // answer refuses the request, before any `100 Continue`. Must be cheap.
  std::function<std::optional<Response>(const IncomingRequest&)> admit = {};
};

struct Options {
  std::string host = "0.0.0.0";  // an IP literal (IPv6 with or without brackets) or a resolvable name
  int port = 0;                  // 0: any free port (see Server::port)
  int io_threads = 1;
  // Connections beyond this are closed as soon as they are accepted.
  std::size_t max_connections = 256;
  // Connections from one client address beyond this are closed as soon as they are accepted, so that one
  // address cannot take every connection; below max_connections (checked), 0: no per-address cap.
  std::size_t max_connections_per_peer = 64;
  // The threads that run POST handlers, and how many requests may wait for one; a request beyond that is
  // answered 503 at once instead of waiting behind unbounded work.
  int workers = 2;
  std::size_t max_queued_requests = 256;
  // A request (head and body) must arrive within this from the moment the server starts waiting for it; the
  // same bound closes a keep-alive connection that stays idle. Slowloris clients are cut off by it.
  std::chrono::milliseconds read_timeout{10'000};
  // A client that does not read its answer is cut off after this: no write may take longer.
  std::chrono::milliseconds write_timeout{10'000};
  // A stream whose client reads too slowly is cancelled once this much of its output waits unsent (in the
  // server and in the kernel's send buffer), long before the write deadline would notice: without it a
  // stalled client holds its request to the end and megabytes of buffered output.
  std::size_t max_unsent_bytes = std::size_t{1} << 20;
  std::uint32_t max_header_bytes = 8 * 1024;
  std::uint64_t max_body_bytes = 64 * 1024;
  // The answer to a request the server refuses itself (unknown path 404, method 405, head 431, body 413,
  // malformed 400); unset: plain text.
  std::function<Response(unsigned status, std::string_view message)> error_response = {};
  // Serve HTTPS with these (checked) credentials; null: plain HTTP. The TLS handshake must complete within
  // read_timeout, like the request after it.
  std::shared_ptr<const security::TlsCredentials> tls = {};
};

class Server {
 public:
  // Binds and starts serving `routes`: exact paths (e.g. "/metrics"), and subtrees (a key ending in '/', e.g.
  // "/v1/models/", serves every longer path under it that has no route of its own). Throws std::runtime_error
  // naming the address when it cannot listen (in use, malformed, not local).
  Server(Options options, std::map<std::string, Route, std::less<>> routes);
  // Stops accepting, cancels the POST handlers, closes every connection and joins the threads.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The port actually bound (useful with port 0).
  [[nodiscard]] int port() const;
  // Connections open now (for tests and diagnostics).
  [[nodiscard]] std::size_t open_connections() const;
  // The server drains: the POST handlers running or queued are cancelled (their stop is requested) and new
  // ones are answered 503; GET routes and producers that already answer carry on.
  void cancel_pending();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace capserve::server::http
