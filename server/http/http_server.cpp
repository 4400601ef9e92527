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

#include <array>
#include <atomic>
#include <cstdio>
#include <exception>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace capserve::server::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;

using Routes = std::map<std::string, Route, std::less<>>;

// What every connection shares: the routes, the limits and the count of open connections.
struct Shared {
  Options options;
  Routes routes;
  std::shared_ptr<asio::ssl::context> tls;  // null: plain TCP
  std::atomic<std::size_t> connections{0};
};

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
  Session(tcp::socket&& socket, Shared& shared) requires std::is_same_v<Stream, PlainStream>
      : stream_(std::move(socket)), shared_(shared) {}
  Session(tcp::socket&& socket, Shared& shared) requires std::is_same_v<Stream, TlsStream>
      : stream_(std::move(socket), *shared.tls), shared_(shared) {}
  ~Session() {
    if (producer_ && !produced_) producer_->abandon();  // e.g. the server stops: its requests are cancelled
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
  void read(bool restart_deadline = true) {
    parser_.emplace();
    parser_->header_limit(shared_.options.max_header_bytes);
    parser_->body_limit(shared_.options.max_body_bytes);
    if (restart_deadline) lowest().expires_after(shared_.options.read_timeout);
    bhttp::async_read(
        stream_, buffer_, *parser_,
        [self = this->shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

  void on_read(const beast::error_code& ec) {
    if (ec == bhttp::error::header_limit) return answer(431, "request header too large", false);
    if (ec == bhttp::error::body_limit) return answer(413, "request body too large", false);
    if (ec == bhttp::error::end_of_stream || !is_parse_error(ec)) {
      if (ec) return close();  // the client left, a network error, or the read deadline passed
    } else {
      return answer(400, "malformed HTTP request", false);
    }
    const auto& request = parser_->get();
    const bool keep_alive = request.keep_alive();
    const auto target = request.target();
    std::string_view path(target.data(), target.size());
    path = path.substr(0, path.find('?'));
    const auto route = shared_.routes.find(path);
    if (route == shared_.routes.end()) return answer(404, "not found", keep_alive);
    const bool get = route->second.method == Method::get;
    const bool head = get && request.method() == bhttp::verb::head;
    if (!head && request.method() != (get ? bhttp::verb::get : bhttp::verb::post))
      return answer(405, get ? "method not allowed: use GET or HEAD" : "method not allowed: use POST",
                    keep_alive);
    Response response;
    try {
      IncomingRequest in{request.body(), peer(), [&request](std::string_view name) {
                           const auto it = request.find(beast::string_view(name.data(), name.size()));
                           return it == request.end()
                                      ? std::string_view()
                                      : std::string_view(it->value().data(), it->value().size());
                         }};
      response = route->second.handler(in);
    } catch (const std::exception& e) {
      response = {500, "text/plain; charset=utf-8", std::string("internal error: ") + e.what() + "\n"};
    }
    if (response.producer) return begin_production(std::move(response), request.version());
    if (head) {
      bhttp::response<bhttp::empty_body> res{static_cast<bhttp::status>(response.status), request.version()};
      res.set(bhttp::field::content_type, response.content_type);
      for (const auto& [name, value] : response.headers) res.set(name, value);
      res.content_length(response.body.size());
      return send(std::move(res), keep_alive);
    }
    send(make(std::move(response), request.version()), keep_alive);
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
    Response response = shared_.options.error_response
                            ? shared_.options.error_response(status, text)
                            : Response{status, "text/plain; charset=utf-8", std::string(text) + "\n"};
    auto res = make(std::move(response), 11);
    if (status == 405) res.set(bhttp::field::allow, text.ends_with("POST") ? "POST" : "GET, HEAD");
    send(std::move(res), keep_alive);
  }

  // A response that waits on a Producer. The connection closes after it (a read stays pending meanwhile, to
  // see the client leave, so no further request could be parsed cleanly anyway). While waiting, only writes
  // have a deadline: a stream may be silent for as long as its request waits in the queue.
  void begin_production(Response response, unsigned version) {
    producer_ = std::move(response.producer);
    if (response.stream) {
      bhttp::response<bhttp::empty_body> head{static_cast<bhttp::status>(response.status), version};
      head.set(bhttp::field::content_type, response.content_type);
      head.set(bhttp::field::cache_control, "no-cache");
      for (const auto& [name, value] : response.headers) head.set(name, value);
      head.set(bhttp::field::server, "capserve");
      head.chunked(true);
      head.keep_alive(false);
      // The head as text; the body follows as chunks framed by hand in pump().
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

  // Reads (and drops) whatever the client sends while its response is produced: an error or end of stream
  // means it went away, which abandons the producer (cancelling its requests) at once.
  void watch_client() {
    stream_.async_read_some(asio::buffer(discarded_),
                            [self = this->shared_from_this()](beast::error_code ec, std::size_t) {
                              if (!ec) return self->watch_client();
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

  void pump() {
    if (writing_ || closed_ || finished_ || !producer_) return;
    if (!produced_) {
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
      if (!produced_) return;
      if (!failed_) whole_.status = producer_->status();
      whole_.body = std::move(produced_body_);
      finished_ = true;
      auto res = make(std::move(whole_), whole_version_);
      res.set(bhttp::field::server, "capserve");
      res.keep_alive(false);
      auto owned = std::make_shared<bhttp::response<bhttp::string_body>>(std::move(res));
      writing_ = true;
      lowest().expires_after(shared_.options.write_timeout);
      bhttp::async_write(stream_, *owned,
                         [self = this->shared_from_this(), owned](beast::error_code ec, std::size_t) {
                           self->writing_ = false;
                           if (ec) return self->close();
                           self->finish_production();
                         });
      return;
    }
    if (!produced_body_.empty()) {
      char size[20];
      const int n = std::snprintf(size, sizeof size, "%zx\r\n", produced_body_.size());
      pending_out_.append(size, static_cast<std::size_t>(n)).append(produced_body_).append("\r\n");
      produced_body_.clear();
    }
    if (produced_) {
      pending_out_.append("0\r\n\r\n");
      finished_ = true;
    }
    if (pending_out_.empty()) return;
    writing_ = true;
    out_.swap(pending_out_);
    pending_out_.clear();
    lowest().expires_after(shared_.options.write_timeout);
    asio::async_write(stream_, asio::buffer(out_),
                      [self = this->shared_from_this(), last = produced_](beast::error_code ec, std::size_t) {
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
  // A response from a Producer.
  std::shared_ptr<Producer> producer_;
  Response whole_;  // not streamed: the head to send once the body is complete
  unsigned whole_version_ = 11;
  bool streaming_ = false;
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
      if (shared.connections.load() >= shared.options.max_connections) {
        beast::error_code ignored;
        socket.close(ignored);
      } else {
        shared.connections.fetch_add(1);
        if (shared.tls)
          std::make_shared<Session<TlsStream>>(std::move(socket), shared)->start();
        else
          std::make_shared<Session<PlainStream>>(std::move(socket), shared)->start();
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
  m.accept();
  for (int i = 0; i < m.shared.options.io_threads; ++i) m.threads.emplace_back([&io = m.io] { io.run(); });
}

Server::~Server() {
  Impl& m = *impl_;
  m.io.stop();
  for (std::thread& t : m.threads) t.join();
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

}  // namespace capserve::server::http
