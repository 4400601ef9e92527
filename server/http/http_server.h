#pragma once
// A small hardened HTTP/1.1 server for rank 0's plain HTTP endpoints (today `/metrics`), on Boost.Beast over
// Asio. It replaces prometheus-cpp's civetweb exposer, which died with SIGSEGV on any 404/405 answer (Debian
// civetweb 1.15) and let two idle or slowloris sockets block every scrape. Here each connection is an
// asynchronous state machine on a fixed number of I/O threads, so an idle socket holds no thread; a request
// must arrive whole within a deadline, headers and bodies are bounded, paths match exactly (the query string
// aside), and anything else gets a clean 4xx answer.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace capserve::server::http {

struct Response {
  unsigned status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// Answers GET (and HEAD: the same head, no body) of one path. Runs on an I/O thread: keep it short. An
// exception becomes a 500 answer.
using Handler = std::function<Response()>;

struct Options {
  std::string host = "0.0.0.0";  // an IP literal (IPv6 with or without brackets) or a resolvable name
  int port = 0;                  // 0: any free port (see Server::port)
  int io_threads = 1;
  // Connections beyond this are closed as soon as they are accepted.
  std::size_t max_connections = 256;
  // A request (head and body) must arrive within this from the moment the server starts waiting for it; the
  // same bound closes a keep-alive connection that stays idle. Slowloris clients are cut off by it.
  std::chrono::milliseconds read_timeout{10'000};
  // A client that does not read its answer is cut off after this.
  std::chrono::milliseconds write_timeout{10'000};
  std::uint32_t max_header_bytes = 8 * 1024;
  std::uint64_t max_body_bytes = 64 * 1024;
};

class Server {
 public:
  // Binds and starts serving `routes` (exact paths, e.g. "/metrics"). Throws std::runtime_error naming the
  // address when it cannot listen (in use, malformed, not local).
  Server(Options options, std::map<std::string, Handler, std::less<>> routes);
  // Stops accepting, closes every connection and joins the I/O threads.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The port actually bound (useful with port 0).
  [[nodiscard]] int port() const;
  // Connections open now (for tests and diagnostics).
  [[nodiscard]] std::size_t open_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace capserve::server::http
