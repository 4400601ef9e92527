#pragma once
// A minimal HTTP/1.1 GET over plain TCP for scraping a Prometheus /metrics endpoint (no TLS, no redirects):
// Content-Length, chunked and read-to-close bodies.
#include <chrono>
#include <string>

namespace capserve::loadgen {

struct Url {
  std::string host;
  std::string port = "80";
  std::string path = "/";
};

// "http://host:port/path" (IPv6 hosts in brackets). Throws std::invalid_argument naming what is wrong.
Url parse_http_url(const std::string& url);

// The body of a 200 response. Throws std::runtime_error naming the URL on a connection failure, a timeout
// (for the whole exchange), a non-200 status or a malformed response.
std::string http_get(const std::string& url, std::chrono::milliseconds timeout);

}  // namespace capserve::loadgen
