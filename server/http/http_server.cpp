#include "server/http/http_server.h"

#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>

#include <linux/sockios.h>
#include <sys/ioctl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <stop_token>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace capserve::server::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;

using Routes = std::map<std::string, Route, std::less<>>;

// A few threads for the POST handlers, with a bounded queue. Parsing, rendering and tokenizing a request can
// take seconds; on an I/O thread it would hold up /health, /metrics and every stream on that thread.
class WorkerPool {
 public:
  void start(int threads, std::size_t capacity) {
    capacity_ = capacity;
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
  }
  ~WorkerPool() { stop(); }

  // False when the queue is full (or the pool stopped): the caller refuses the request at once.
  bool try_submit(std::function<void()> job) {
    {
      std::lock_guard lock(mutex_);
      if (stopped_ || jobs_.size() >= capacity_) return false;
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
    return true;
  }

  // Drops the queued jobs and joins the threads once their running jobs return.
  void stop() {
    std::deque<std::function<void()>> dropped;
    {
      std::lock_guard lock(mutex_);
      stopped_ = true;
      dropped.swap(jobs_);
    }
    ready_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [this] { return stopped_ || !jobs_.empty(); });
        if (stopped_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  std::size_t capacity_ = 0;
  bool stopped_ = false;
  std::vector<std::thread> threads_;
};

// What every connection shares: the routes, the limits, the workers and the counts of open connections.
struct Shared {
  Options options;
  Routes routes;
  std::shared_ptr<asio::ssl::context> tls;  // null: plain TCP
  std::atomic<std::size_t> connections{0};
  std::mutex peers_mutex;
  std::unordered_map<std::string, std::size_t> peer_connections;  // open, by client address
  // Requested when the server drains or stops: cancels the POST handlers.
  std::stop_source stopping;
  WorkerPool workers;

  // Takes one of `address`'s connections, or false when it has its share.
  bool enter(const std::string& address) {
    std::lock_guard lock(peers_mutex);
    std::size_t& n = peer_connections[address];
    if (options.max_connections_per_peer > 0 && n >= options.max_connections_per_peer) return false;
    ++n;
    return true;
  }
  void leave(const std::string& address) {
    std::lock_guard lock(peers_mutex);
    const auto it = peer_connections.find(address);
    if (--it->second == 0) peer_connections.erase(it);
  }

  Response error(unsigned status, std::string_view text) const {
    return options.error_response ? options.error_response(status, text)
                                  : Response{status, "text/plain; charset=utf-8", std::string(text) + "\n"};
  }
};

// The request target without its query string.
std::string_view target_path(const bhttp::request_header<>& head) {
  const auto target = head.target();
  const std::string_view path(target.data(), target.size());
  return path.substr(0, path.find('?'));
}

// The route of `path`: its own, else the longest subtree route (a key ending in '/') it lies strictly under.
const Route* find_route(const Routes& routes, std::string_view path) {
  if (const auto exact = routes.find(path); exact != routes.end()) return &exact->second;
  const Route* found = nullptr;
  std::size_t longest = 0;
  for (const auto& [key, route] : routes) {
    if (key.ends_with('/') && path.size() > key.size() && path.starts_with(key) && key.size() > longest) {
      found = &route;
      longest = key.size();
    }
  }
  return found;
}

// RFC 7230 §3.3.3: a request body is framed by Content-Length, or by Transfer-Encoding whose last coding is
// chunked. Any other Transfer-Encoding (xchunked, identity, gzip, "chunked, identity") would leave the body
// to be parsed as the next request, a request-smuggling shape, and both headers together are ambiguous;
// content codings before chunked ("gzip, chunked") are not decoded here. The refusal's status and text, or
// none.
std::optional<std::pair<unsigned, std::string_view>> framing_error(const bhttp::request_header<>& head) {
  const auto te = head.find(bhttp::field::transfer_encoding);
  if (te == head.end()) return std::nullopt;
  if (head.find(bhttp::field::content_length) != head.end())
    return std::pair{400U, "Content-Length together with Transfer-Encoding"};
  std::vector<std::string> codings;
  std::string coding;
  for (const char ch : std::string(te->value()) + ",") {
    if (ch == ',') {
      codings.push_back(std::exchange(coding, {}));
    } else if (ch != ' ' && ch != '\t') {
      coding += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    }
  }
  if (head.count(bhttp::field::transfer_encoding) == 1 && codings.size() == 1 && codings[0] == "chunked")
    return std::nullopt;
  if (codings.size() > 1 && codings.back() == "chunked" && head.count(bhttp::field::transfer_encoding) == 1)
    return std::pair{501U,
                     "content codings in Transfer-Encoding are not supported; send the body chunked only"};
  return std::pair{400U, "unsupported Transfer-Encoding: only chunked"};
}

// The client's address without its port: what the per-address connection cap counts.
std::string address_of(const tcp::socket& socket) {
  beast::error_code ec;
  const tcp::endpoint remote = socket.remote_endpoint(ec);
  return ec ? std::string("unknown") : remote.address().to_string();
}

bool is_parse_error(const beast::error_code& ec) {
  return &ec.category() == &bhttp::make_error_code(bhttp::error::bad_target).category();
}

// "host:port" for messages, with an IPv6 literal in brackets.
std::string describe(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos && !host.starts_with('[');
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

using PlainStream = beast::tcp_stream;
using TlsStream = beast::ssl_stream<beast::tcp_stream>;

// One connection, over plain TCP or TLS: the same state machine, with TLS's handshake first. Every deadline
// is on the TCP layer; the handshake and the first request share one read deadline, so TLS gives a slowloris
// client no extra time.
template <typename Stream>
class Session : public std::enable_shared_from_this<Session<Stream>> {
 public:
  Session(tcp::socket&& socket, Shared& shared,
          std::string address) requires std::is_same_v<Stream, PlainStream>
      : stream_(std::move(socket)), shared_(shared), address_(std::move(address)) {}
  Session(tcp::socket&& socket, Shared& shared,
          std::string address) requires std::is_same_v<Stream, TlsStream>
      : stream_(std::move(socket), *shared.tls), shared_(shared), address_(std::move(address)) {}
  ~Session() {
    if (producer_ && !produced_) producer_->abandon();  // e.g. the server stops: its requests are cancelled
    shared_.leave(address_);
    shared_.connections.fetch_sub(1);
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void start() {
    asio::dispatch(stream_.get_executor(), [self = this->shared_from_this()] {
      if constexpr (std::is_same_v<Stream, TlsStream>) {
        self->lowest().expires_after(self->shared_.options.read_timeout);
        self->stream_.async_handshake(asio::ssl::stream_base::server, [self](beast::error_code ec) {
          if (ec) return self->close();  // not TLS, no client certificate under mTLS, or too slow
          self->read(false);             // the first request must arrive within the handshake's deadline
        });
      } else {
        self->read();
      }
    });
  }

 private:
  beast::tcp_stream& lowest() { return beast::get_lowest_layer(stream_); }

  // `restart_deadline` false: the deadline already running (the TLS handshake's) covers the request too.
  // The head comes first and is checked before the body is read (framing, route, admission, Expect).
  void read(bool restart_deadline = true) {
    parser_.emplace();
    parser_->header_limit(shared_.options.max_header_bytes);
    parser_->body_limit(shared_.options.max_body_bytes);
    if (restart_deadline) lowest().expires_after(shared_.options.read_timeout);
    bhttp::async_read_header(
        stream_, buffer_, *parser_,
        [self = this->shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  // Answers a failed read; false when there was none.
  bool read_failed(const beast::error_code& ec) {
    if (!ec) return false;
    if (ec == bhttp::error::header_limit) {
      answer(431, "request header too large", false);
    } else if (ec == bhttp::error::body_limit) {
      answer(413, "request body too large", false);
    } else if (ec != bhttp::error::end_of_stream && is_parse_error(ec)) {
      answer(400, "malformed HTTP request", false);
    } else {
      close();  // the client left, a network error, or the read deadline passed
    }
    return true;
  }

  void on_header(const beast::error_code& ec) {
    if (read_failed(ec)) return;
    const auto& request = parser_->get();
    // A refusal before the body is read keeps the connection only when there is no body to skip.
    const bool keep_alive = request.keep_alive() && parser_->is_done();
    if (const auto refused = framing_error(request)) return answer(refused->first, refused->second, false);
    route_ = find_route(shared_.routes, target_path(request));
    if (route_ == nullptr) return answer(404, "not found", keep_alive);
    const bool get = route_->method == Method::get;
    head_ = get && request.method() == bhttp::verb::head;
    if (!head_ && request.method() != (get ? bhttp::verb::get : bhttp::verb::post))
      return answer(405, get ? "method not allowed: use GET or HEAD" : "method not allowed: use POST",
                    keep_alive);
    if (route_->admit) {
      if (std::optional<Response> refused = route_->admit(incoming()))
        return respond(std::move(*refused), keep_alive);
    }
    // RFC 7231 §5.1.1: HTTP/1.0 expectations are ignored; 100-continue is answered once the head is accepted
    // (curl waits a second for it before sending a body over 1 KiB), any other expectation is refused.
    const auto expect = request.find(bhttp::field::expect);
    if (expect != request.end() && request.version() >= 11) {
      if (!beast::iequals(expect->value(), "100-continue"))
        return answer(417, "expectation failed: only 100-continue is supported", false);
      if (!parser_->is_done()) {
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        asio::async_write(stream_, asio::buffer(kContinue.data(), kContinue.size()),
                          [self = this->shared_from_this()](beast::error_code e, std::size_t) {
                            if (e) return self->close();
                            self->read_body();
                          });
        return;
      }
    }
    read_body();
  }

  void read_body() {
    if (parser_->is_done()) return on_read({});
    bhttp::async_read(
        stream_, buffer_, *parser_,
        [self = this->shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

  void on_read(const beast::error_code& ec) {
    if (read_failed(ec)) return;
    if (route_->method == Method::post) return offload();
    respond(call(incoming()), parser_->get().keep_alive());
  }

  // The request as the handlers see it; it refers to the parser, which stays until the answer is out.
  IncomingRequest incoming() {
    const auto& request = parser_->get();
    return {request.body(), peer(),
            [&request](std::string_view name) {
              const auto it = request.find(beast::string_view(name.data(), name.size()));
              return it == request.end() ? std::string_view()
                                         : std::string_view(it->value().data(), it->value().size());
            },
            stop_.get_token(), target_path(request)};
  }

  Response call(const IncomingRequest& in) {
    try {
      return route_->handler(in);
    } catch (const std::exception& e) {
      return {500, "text/plain; charset=utf-8", std::string("internal error: ") + e.what() + "\n"};
    }
  }

  // A POST: its handler runs on a worker while this connection watches for its client leaving (which stops
  // the handler's work); the answer comes back on this connection's strand and closes the connection (the
  // watch has read past the request, so no further one could be parsed cleanly).
  void offload() {
    auto job = [self = this->shared_from_this(), in = incoming()] {
      Response response;
      if (self->shared_.stopping.stop_requested()) {
        response = self->shared_.error(503, "the server is shutting down");
      } else {
        const std::stop_callback forward(self->shared_.stopping.get_token(),
                                         [&self] { self->stop_.request_stop(); });
        response = self->call(in);
      }
      auto executor = self->stream_.get_executor();
      asio::post(executor, [self = std::move(self), response = std::move(response)]() mutable {
        self->on_handled(std::move(response));
      });
    };
    if (!shared_.workers.try_submit(std::move(job)))
      return answer(503, "the server is busy: too many requests are being prepared; retry later",
                    parser_->get().keep_alive());
    lowest().expires_never();
    watch_client();
  }

  void on_handled(Response response) {
    if (closed_) {
      if (response.producer) response.producer->abandon();  // the client left while it was prepared
      return;
    }
    if (response.producer) return begin_production(std::move(response), parser_->get().version());
    auto res = make(std::move(response), parser_->get().version());
    res.set(bhttp::field::server, "capserve");
    res.keep_alive(false);
    write_last(std::make_shared<bhttp::response<bhttp::string_body>>(std::move(res)));
  }

  // An answer made on the I/O thread, from a GET handler or an admission check.
  void respond(Response response, bool keep_alive) {
    const unsigned version = parser_->get().version();
    if (response.producer) return begin_production(std::move(response), version);
    if (head_) {
      bhttp::response<bhttp::empty_body> res{static_cast<bhttp::status>(response.status), version};
      res.set(bhttp::field::content_type, response.content_type);
      for (const auto& [name, value] : response.headers) res.set(name, value);
      res.content_length(response.body.size());
      return send(std::move(res), keep_alive);
    }
    send(make(std::move(response), version), keep_alive);
  }

  // The client's address in gRPC's notation, so that per-address limits count both APIs alike.
  std::string peer() {
    beast::error_code ec;
    const tcp::endpoint remote = lowest().socket().remote_endpoint(ec);
    if (ec) return "unknown";
    const auto address = remote.address();
    const std::string port = std::to_string(remote.port());
    return address.is_v4() ? "ipv4:" + address.to_string() + ":" + port
                           : "ipv6:[" + address.to_string() + "]:" + port;
  }

  static bhttp::response<bhttp::string_body> make(Response response, unsigned version) {
    bhttp::response<bhttp::string_body> res{static_cast<bhttp::status>(response.status), version};
    res.set(bhttp::field::content_type, std::move(response.content_type));
    for (auto& [name, value] : response.headers) res.set(name, value);
    res.body() = std::move(response.body);
    res.prepare_payload();
    return res;
  }

  void answer(unsigned status, std::string_view text, bool keep_alive) {
    auto res = make(shared_.error(status, text), 11);
    if (status == 405) res.set(bhttp::field::allow, text.ends_with("POST") ? "POST" : "GET, HEAD");
    send(std::move(res), keep_alive);
  }

  // A response that waits on a Producer. The connection closes after it (a read stays pending meanwhile, to
  // see the client leave, so no further request could be parsed cleanly anyway). While waiting, only writes
  // have a deadline: a stream may be silent for as long as its request waits in the queue. HTTP/1.0 clients
  // cannot read chunked framing: their stream is the bare body, ended by closing the connection.
  void begin_production(Response response, unsigned version) {
    producer_ = std::move(response.producer);
    if (response.stream) {
      bhttp::response<bhttp::empty_body> head{static_cast<bhttp::status>(response.status), version};
      head.set(bhttp::field::content_type, response.content_type);
      head.set(bhttp::field::cache_control, "no-cache");
      for (const auto& [name, value] : response.headers) head.set(name, value);
      head.set(bhttp::field::server, "capserve");
      chunked_ = version >= 11;
      head.chunked(chunked_);
      head.keep_alive(false);
      // The head as text; the body follows, as chunks framed by hand in pump() where chunked.
      std::ostringstream os;
      os << head.base();
      pending_out_ = os.str();
      streaming_ = true;
    } else {
      whole_ = std::move(response);
      whole_version_ = version;
    }
    lowest().expires_never();
    watch_client();
    producer_->start([weak = this->weak_from_this()] {
      if (auto self = weak.lock()) self->wake();
    });
    pump();
  }

  void wake() {
    if (wake_posted_.exchange(true)) return;
    asio::post(stream_.get_executor(), [self = this->shared_from_this()] {
      self->wake_posted_.store(false);
      self->pump();
    });
  }

  // Reads (and drops) whatever the client sends while its response is prepared or produced: an error or end
  // of stream means it went away, which stops a running handler and abandons the producer (cancelling its
  // requests) at once. Started once per connection.
  void watch_client() {
    if (std::exchange(watching_, true)) return;
    watch();
  }
  void watch() {
    stream_.async_read_some(asio::buffer(discarded_),
                            [self = this->shared_from_this()](beast::error_code ec, std::size_t) {
                              if (!ec) return self->watch();
                              self->stop_.request_stop();
                              if (!self->produced_) self->abandon();
                              self->close();
                            });
  }

  void abandon() {
    if (producer_ && !produced_) {
      produced_ = true;
      producer_->abandon();
    }
  }

  // Output of a stream not yet taken by the client: framed here, being written, and in the kernel's send
  // queue (bytes not yet acknowledged: a client that stops reading fills it).
  std::size_t unsent() {
    int queued = 0;
    if (::ioctl(lowest().socket().native_handle(), SIOCOUTQ, &queued) != 0) queued = 0;
    return pending_out_.size() + out_.size() + static_cast<std::size_t>(std::max(queued, 0));
  }

  void pump() {
    if (closed_ || finished_ || !producer_) return;
    if (!produced_ && (streaming_ || !writing_)) {
      try {
        produced_ = producer_->poll(produced_body_);
      } catch (const std::exception& e) {
        // A broken producer ends the response; its requests are cancelled.
        producer_->abandon();
        produced_ = true;
        failed_ = true;
        if (!streaming_) {
          whole_.status = 500;
          whole_.content_type = "text/plain; charset=utf-8";
          produced_body_ = std::string("internal error: ") + e.what() + "\n";
        }
      }
    }
    if (!streaming_) {
      if (!produced_ || writing_) return;
      if (!failed_) whole_.status = producer_->status();
      whole_.body = std::move(produced_body_);
      auto res = make(std::move(whole_), whole_version_);
      res.set(bhttp::field::server, "capserve");
      res.keep_alive(false);
      write_last(std::make_shared<bhttp::response<bhttp::string_body>>(std::move(res)));
      return;
    }
    if (!produced_body_.empty()) {
      if (chunked_) {
        char size[20];
        const int n = std::snprintf(size, sizeof size, "%zx\r\n", produced_body_.size());
        pending_out_.append(size, static_cast<std::size_t>(n)).append(produced_body_).append("\r\n");
      } else {
        pending_out_.append(produced_body_);
      }
      produced_body_.clear();
    }
    if (!produced_ && unsent() > shared_.options.max_unsent_bytes) {
      // The client stopped reading: cancel its requests now rather than buffer their output to the end.
      abandon();
      return close();
    }
    if (writing_) return;  // the write's completion pumps again
    if (produced_) {
      if (chunked_) pending_out_.append("0\r\n\r\n");
      finished_ = true;
    }
    if (pending_out_.empty()) return;
    writing_ = true;
    out_.swap(pending_out_);
    pending_out_.clear();
    lowest().expires_after(shared_.options.write_timeout);
    asio::async_write(stream_, asio::buffer(out_),
                      [self = this->shared_from_this(), last = finished_](beast::error_code ec, std::size_t) {
                        self->writing_ = false;
                        self->out_.clear();
                        if (ec) {
                          self->abandon();
                          return self->close();
                        }
                        if (last) return self->finish_production();
                        self->pump();
                      });
  }

  // The last answer of a connection whose client is watched: written, then the connection ends.
  void write_last(std::shared_ptr<bhttp::response<bhttp::string_body>> res) {
    finished_ = true;
    writing_ = true;
    lowest().expires_after(shared_.options.write_timeout);
    bhttp::async_write(stream_, *res,
                       [self = this->shared_from_this(), res](beast::error_code ec, std::size_t) {
                         self->writing_ = false;
                         if (ec) return self->close();
                         self->finish_production();
                       });
  }

  // The whole answer is out: stop sending and let the client close; the pending read ends the connection
  // when it does, or the timer after a second.
  void finish_production() {
    beast::error_code ignored;
    lowest().socket().shutdown(tcp::socket::shutdown_send, ignored);
    linger_timer_.expires_after(std::chrono::seconds(1));
    linger_timer_.async_wait([self = this->shared_from_this()](beast::error_code ec) {
      if (!ec) self->close();
    });
  }

  template <typename Body>
  void send(bhttp::response<Body>&& response, bool keep_alive) {
    response.set(bhttp::field::server, "capserve");
    response.keep_alive(keep_alive);
    auto owned = std::make_shared<bhttp::response<Body>>(std::move(response));
    lowest().expires_after(shared_.options.write_timeout);
    bhttp::async_write(
        stream_, *owned,
        [self = this->shared_from_this(), owned, keep_alive](beast::error_code ec, std::size_t) {
          if (ec) return self->close();
          if (!keep_alive) return self->linger();
          self->read();
        });
  }

  // After the last answer: stop sending, then read and discard what the client still sends (e.g. the rest of
  // an oversized request) until it closes or a second passes. Closing with unread input would send a reset
  // that can destroy the answer before the client reads it.
  void linger() {
    beast::error_code ignored;
    lowest().socket().shutdown(tcp::socket::shutdown_send, ignored);
    lowest().expires_after(std::chrono::seconds(1));
    discard();
  }

  void discard() {
    stream_.async_read_some(asio::buffer(discarded_),
                            [self = this->shared_from_this()](beast::error_code ec, std::size_t) {
                              if (ec) return self->close();
                              self->discard();
                            });
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    linger_timer_.cancel();
    beast::error_code ignored;
    lowest().socket().shutdown(tcp::socket::shutdown_both, ignored);
    lowest().close();
  }

  Stream stream_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::array<char, 4096> discarded_{};
  Shared& shared_;
  std::string address_;           // the client's, for the per-address connection count
  const Route* route_ = nullptr;  // the current request's
  bool head_ = false;             // the current request is a HEAD
  std::stop_source stop_;         // the client left, or the server drains: a POST handler's work stops
  bool watching_ = false;         // watch_client's read is pending
  // A response from a Producer.
  std::shared_ptr<Producer> producer_;
  Response whole_;  // not streamed: the head to send once the body is complete
  unsigned whole_version_ = 11;
  bool streaming_ = false;
  bool chunked_ = false;   // a stream to an HTTP/1.1 client: framed in chunks
  bool produced_ = false;  // the producer's body is complete (or abandoned)
  bool failed_ = false;    // the producer threw
  bool finished_ = false;  // the last write of the response is issued
  bool writing_ = false;
  bool closed_ = false;
  std::string produced_body_;  // polled, not yet framed
  std::string pending_out_;    // framed, not yet written
  std::string out_;            // being written
  std::atomic<bool> wake_posted_{false};
  asio::steady_timer linger_timer_{stream_.get_executor()};
};

}  // namespace

struct Server::Impl {
  // Declared before the io_context: sessions destroyed with its pending handlers still count down here.
  Shared shared;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer retry{io};
  std::vector<std::thread> threads;
  int port = 0;

  void accept() {
    acceptor.async_accept(asio::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {
        // E.g. out of file descriptors: try again shortly instead of spinning.
        retry.expires_after(std::chrono::milliseconds(100));
        retry.async_wait([this](beast::error_code e) {
          if (!e) accept();
        });
        return;
      }
      std::string address = address_of(socket);
      if (shared.connections.load() >= shared.options.max_connections || !shared.enter(address)) {
        beast::error_code ignored;
        socket.close(ignored);
      } else {
        shared.connections.fetch_add(1);
        if (shared.tls)
          std::make_shared<Session<TlsStream>>(std::move(socket), shared, std::move(address))->start();
        else
          std::make_shared<Session<PlainStream>>(std::move(socket), shared, std::move(address))->start();
      }
      accept();
    });
  }
};

Server::Server(Options options, Routes routes) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (options.port < 0 || options.port > 65535)
    throw std::invalid_argument("http: port " + std::to_string(options.port) + " is outside 0..65535");
  if (options.io_threads < 1) throw std::invalid_argument("http: io_threads must be >= 1");
  if (options.workers < 1) throw std::invalid_argument("http: workers must be >= 1");
  // One address must not be able to take every connection.
  if (options.max_connections_per_peer >= options.max_connections)
    throw std::invalid_argument(
        "http: max_connections_per_peer (" + std::to_string(options.max_connections_per_peer) +
        ") must be below max_connections (" + std::to_string(options.max_connections) + ")");
  const std::string where = describe(options.host, options.port);
  std::string host = options.host;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);

  beast::error_code ec;
  tcp::endpoint endpoint;
  const auto address = asio::ip::make_address(host, ec);
  if (!ec) {
    endpoint = {address, static_cast<std::uint16_t>(options.port)};
  } else {
    tcp::resolver resolver(m.io);
    const auto found = resolver.resolve(host, std::to_string(options.port), ec);
    if (ec || found.empty())
      throw std::runtime_error("cannot listen on " + where + ": cannot resolve '" + host + "'");
    endpoint = *found.begin();
  }
  auto fail = [&](const beast::error_code& e) {
    throw std::runtime_error("cannot listen on " + where + ": " + e.message());
  };
  if (m.acceptor.open(endpoint.protocol(), ec); ec) fail(ec);
  // SO_REUSEADDR only lets a restarted server bind past TIME_WAIT; unlike SO_REUSEPORT it never lets two
  // listeners share the port.
  if (m.acceptor.set_option(asio::socket_base::reuse_address(true), ec); ec) fail(ec);
  if (m.acceptor.bind(endpoint, ec); ec) fail(ec);
  if (m.acceptor.listen(asio::socket_base::max_listen_connections, ec); ec) fail(ec);
  m.port = m.acceptor.local_endpoint().port();

  if (options.tls) m.shared.tls = security::make_server_tls_context(*options.tls);
  m.shared.options = std::move(options);
  m.shared.routes = std::move(routes);
  m.shared.workers.start(m.shared.options.workers, m.shared.options.max_queued_requests);
  m.accept();
  for (int i = 0; i < m.shared.options.io_threads; ++i) m.threads.emplace_back([&io = m.io] { io.run(); });
}

Server::~Server() {
  Impl& m = *impl_;
  // A running render ends at its next check instead of holding the shutdown.
  m.shared.stopping.request_stop();
  m.io.stop();
  for (std::thread& t : m.threads) t.join();
  m.shared.workers.stop();
  // No thread runs the handlers any more; the open connections go with the io_context's pending handlers.
  beast::error_code ignored;
  m.acceptor.close(ignored);
}

int Server::port() const {
  return impl_->port;
}

std::size_t Server::open_connections() const {
  return impl_->shared.connections.load();
}

void Server::cancel_pending() {
  impl_->shared.stopping.request_stop();
}

}  // namespace capserve::server::http
