#include "server/http/http_server.h"

#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <array>
#include <atomic>
#include <exception>
#include <optional>
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

using Routes = std::map<std::string, Handler, std::less<>>;

// What every connection shares: the routes, the limits and the count of open connections.
struct Shared {
  Options options;
  Routes routes;
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

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket&& socket, Shared& shared) : stream_(std::move(socket)), shared_(shared) {}
  ~Session() { shared_.connections.fetch_sub(1); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void start() {
    asio::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read(); });
  }

 private:
  void read() {
    parser_.emplace();
    parser_->header_limit(shared_.options.max_header_bytes);
    parser_->body_limit(shared_.options.max_body_bytes);
    stream_.expires_after(shared_.options.read_timeout);
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

  void on_read(const beast::error_code& ec) {
    if (ec == bhttp::error::header_limit) return answer(431, "request header too large\n", false);
    if (ec == bhttp::error::body_limit) return answer(413, "request body too large\n", false);
    if (ec == bhttp::error::end_of_stream || !is_parse_error(ec)) {
      if (ec) return close();  // the client left, a network error, or the read deadline passed
    } else {
      return answer(400, "malformed HTTP request\n", false);
    }
    const auto& request = parser_->get();
    const bool keep_alive = request.keep_alive();
    const auto target = request.target();
    std::string_view path(target.data(), target.size());
    path = path.substr(0, path.find('?'));
    const auto route = shared_.routes.find(path);
    if (route == shared_.routes.end()) return answer(404, "not found\n", keep_alive);
    const bool head = request.method() == bhttp::verb::head;
    if (!head && request.method() != bhttp::verb::get)
      return answer(405, "method not allowed: use GET or HEAD\n", keep_alive);
    Response response;
    try {
      response = route->second();
    } catch (const std::exception& e) {
      response = {500, "text/plain; charset=utf-8", std::string("internal error: ") + e.what() + "\n"};
    }
    if (head) {
      bhttp::response<bhttp::empty_body> res{static_cast<bhttp::status>(response.status), request.version()};
      res.set(bhttp::field::content_type, response.content_type);
      res.content_length(response.body.size());
      return send(std::move(res), keep_alive);
    }
    send(make(response.status, std::move(response.content_type), std::move(response.body), request.version()),
         keep_alive);
  }

  static bhttp::response<bhttp::string_body> make(unsigned status, std::string content_type, std::string body,
                                                  unsigned version) {
    bhttp::response<bhttp::string_body> res{static_cast<bhttp::status>(status), version};
    res.set(bhttp::field::content_type, std::move(content_type));
    res.body() = std::move(body);
    res.prepare_payload();
    return res;
  }

  void answer(unsigned status, std::string text, bool keep_alive) {
    auto res = make(status, "text/plain; charset=utf-8", std::move(text), 11);
    if (status == 405) res.set(bhttp::field::allow, "GET, HEAD");
    send(std::move(res), keep_alive);
  }

  template <typename Body>
  void send(bhttp::response<Body>&& response, bool keep_alive) {
    response.set(bhttp::field::server, "capserve");
    response.keep_alive(keep_alive);
    auto owned = std::make_shared<bhttp::response<Body>>(std::move(response));
    stream_.expires_after(shared_.options.write_timeout);
    bhttp::async_write(stream_, *owned,
                       [self = shared_from_this(), owned, keep_alive](beast::error_code ec, std::size_t) {
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
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(std::chrono::seconds(1));
    discard();
  }

  void discard() {
    stream_.async_read_some(asio::buffer(discarded_),
                            [self = shared_from_this()](beast::error_code ec, std::size_t) {
                              if (ec) return self->close();
                              self->discard();
                            });
  }

  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::array<char, 4096> discarded_{};
  Shared& shared_;
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
        std::make_shared<Session>(std::move(socket), shared)->start();
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
