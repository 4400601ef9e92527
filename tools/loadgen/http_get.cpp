#include "tools/loadgen/http_get.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string_view>

namespace capserve::loadgen {
namespace {

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  [[nodiscard]] int fd() const { return fd_; }

 private:
  int fd_;
};

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// Waits until the socket is ready for `events`; false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int r = ::poll(&p, 1, ms_left(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

std::unique_ptr<Socket> connect_to(const Url& u, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* raw = nullptr;
  if (const int rc = ::getaddrinfo(u.host.c_str(), u.port.c_str(), &hints, &raw); rc != 0) {
    error = std::string("cannot resolve host: ") + ::gai_strerror(rc);
    return nullptr;
  }
  const std::unique_ptr<addrinfo, AddrInfoDeleter> list(raw);
  for (const addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
    auto s = std::make_unique<Socket>(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol));
    if (s->fd() < 0) continue;
    if (::connect(s->fd(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS || !wait_for(s->fd(), POLLOUT, deadline)) {
        error = errno == EINPROGRESS ? "connect timed out" : std::strerror(errno);
        continue;
      }
      int so_error = 0;
      socklen_t len = sizeof so_error;
      ::getsockopt(s->fd(), SOL_SOCKET, SO_ERROR, &so_error, &len);
      if (so_error != 0) {
        error = std::strerror(so_error);
        continue;
      }
    }
    return s;
  }
  return nullptr;
}

std::string decode_chunked(std::string_view body) {
  std::string out;
  std::size_t pos = 0;
  for (;;) {
    const std::size_t eol = body.find("\r\n", pos);
    if (eol == std::string_view::npos) throw std::runtime_error("truncated chunked body");
    const std::size_t size = std::stoul(std::string(body.substr(pos, eol - pos)), nullptr, 16);
    pos = eol + 2;
    if (size == 0) return out;
    if (pos + size > body.size()) throw std::runtime_error("truncated chunk");
    out.append(body.substr(pos, size));
    pos += size + 2;
  }
}

bool header_is(std::string_view headers, std::string_view name, std::string_view value) {
  // Case-insensitive search for "\r\nname: value".
  auto lower = [](std::string_view s) {
    std::string l(s);
    for (char& c : l) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    return l;
  };
  const std::string h = lower(headers);
  std::size_t at = h.find("\r\n" + lower(name) + ":");
  if (at == std::string::npos) return false;
  at += name.size() + 3;
  const std::size_t end = h.find("\r\n", at);
  return h.substr(at, end - at).find(lower(value)) != std::string::npos;
}

}  // namespace

Url parse_http_url(const std::string& url) {
  constexpr std::string_view scheme = "http://";
  if (!url.starts_with(scheme))
    throw std::invalid_argument("metrics URL '" + url +
                                "': must start with http:// (e.g. http://localhost:9400/metrics)");
  std::string_view rest = std::string_view(url).substr(scheme.size());
  Url u;
  const std::size_t slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  if (slash != std::string_view::npos) u.path = std::string(rest.substr(slash));
  if (authority.starts_with('[')) {
    const std::size_t close = authority.find(']');
    if (close == std::string_view::npos) throw std::invalid_argument("metrics URL '" + url + "': unclosed [");
    u.host = std::string(authority.substr(1, close - 1));
    authority.remove_prefix(close + 1);
    if (authority.starts_with(':')) u.port = std::string(authority.substr(1));
  } else {
    const std::size_t colon = authority.rfind(':');
    u.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) u.port = std::string(authority.substr(colon + 1));
  }
  if (u.host.empty() || u.port.empty())
    throw std::invalid_argument("metrics URL '" + url + "': no host or port");
  return u;
}

std::string http_get(const std::string& url, std::chrono::milliseconds timeout) {
  const Url u = parse_http_url(url);
  const Clock::time_point deadline = Clock::now() + timeout;
  auto fail = [&](const std::string& why) { return std::runtime_error("GET " + url + ": " + why); };
  std::string error = "no address";
  const std::unique_ptr<Socket> s = connect_to(u, deadline, error);
  if (!s) throw fail(error);

  const std::string request = "GET " + u.path + " HTTP/1.1\r\nHost: " + u.host + ":" + u.port +
                              "\r\nAccept: text/plain\r\nConnection: close\r\n\r\n";
  for (std::size_t sent = 0; sent < request.size();) {
    if (!wait_for(s->fd(), POLLOUT, deadline)) throw fail("timed out sending");
    const ssize_t n = ::send(s->fd(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) throw fail(std::strerror(errno));
    if (n > 0) sent += static_cast<std::size_t>(n);
  }
  std::string response;
  char buffer[16384];
  for (;;) {
    if (!wait_for(s->fd(), POLLIN, deadline)) throw fail("timed out reading the response");
    const ssize_t n = ::recv(s->fd(), buffer, sizeof buffer, 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      throw fail(std::strerror(errno));
    }
    response.append(buffer, static_cast<std::size_t>(n));
  }
  const std::size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos) throw fail("malformed response (no header end)");
  const std::string_view headers = std::string_view(response).substr(0, header_end + 2);
  const std::size_t sp = headers.find(' ');
  if (!headers.starts_with("HTTP/1.") || sp == std::string_view::npos) throw fail("malformed status line");
  const std::string_view code = headers.substr(sp + 1, 3);
  if (code != "200")
    throw fail("HTTP status " + std::string(headers.substr(sp + 1, headers.find('\r') - sp - 1)));
  const std::string_view body = std::string_view(response).substr(header_end + 4);
  try {
    if (header_is(std::string_view(response).substr(0, header_end + 2), "Transfer-Encoding", "chunked"))
      return decode_chunked(body);
  } catch (const std::exception& e) {
    throw fail(e.what());
  }
  return std::string(body);
}

}  // namespace capserve::loadgen
