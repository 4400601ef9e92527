#include "server/security/tls_credentials.h"

#include <boost/asio/buffer.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/system/system_error.hpp>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string_view>

namespace capserve::server::security {
namespace {

namespace ssl = boost::asio::ssl;

std::string read_pem(std::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error(std::string(flag) + " " + path + ": cannot read: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  if (pem.find("-----BEGIN ") == std::string::npos)
    throw std::runtime_error(std::string(flag) + " " + path + ": not a PEM file (no -----BEGIN line)");
  return pem;
}

// Runs one OpenSSL step, turning its error into a message that names what was being loaded.
template <typename F>
void step(std::string_view what, F&& f) {
  try {
    f();
  } catch (const boost::system::system_error& e) {
    throw std::runtime_error(std::string(what) + ": " + e.code().message());
  }
}

}  // namespace

TlsCredentials load_tls_credentials(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty())
    throw std::runtime_error("--tls-cert and --tls-key go together: give both or neither");
  if (files.cert.empty()) throw std::runtime_error("--tls-client-ca needs --tls-cert and --tls-key");
  TlsCredentials c{read_pem("--tls-cert", files.cert), read_pem("--tls-key", files.key),
                   files.client_ca.empty() ? std::string() : read_pem("--tls-client-ca", files.client_ca)};
  try {
    make_server_tls_context(c);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string(e.what()) + " (--tls-cert " + files.cert + ", --tls-key " +
                             files.key +
                             (files.client_ca.empty() ? "" : ", --tls-client-ca " + files.client_ca) + ")");
  }
  return c;
}

std::shared_ptr<ssl::context> make_server_tls_context(const TlsCredentials& c) {
  auto context = std::make_shared<ssl::context>(ssl::context::tls_server);
  context->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                       ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 | ssl::context::single_dh_use);
  step("the certificate chain is not valid PEM",
       [&] { context->use_certificate_chain(boost::asio::buffer(c.cert_chain_pem)); });
  // OpenSSL checks the key against the certificate loaded above: a key of another pair fails here.
  step("the private key is not valid PEM or does not match the certificate",
       [&] { context->use_private_key(boost::asio::buffer(c.private_key_pem), ssl::context::pem); });
  if (!c.client_ca_pem.empty()) {
    step("the client CA bundle is not valid PEM",
         [&] { context->add_certificate_authority(boost::asio::buffer(c.client_ca_pem)); });
    context->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
  }
  return context;
}

}  // namespace capserve::server::security
