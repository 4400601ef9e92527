#include "server/security/tls_credentials.h"

#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <boost/asio/buffer.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/system/system_error.hpp>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
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

std::string asn1_time_text(const ASN1_TIME* time) {
  const std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
  if (!bio || ASN1_TIME_print(bio.get(), time) != 1) return "an unreadable date";
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return {data, static_cast<std::size_t>(size)};
}

// Why the chain's first (leaf) certificate is not valid now, naming the date; "" when it is.
std::string validity_warning(const std::string& cert_path, const std::string& chain_pem) {
  const std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(chain_pem.data(), static_cast<int>(chain_pem.size())), BIO_free);
  const std::unique_ptr<X509, decltype(&X509_free)> leaf(
      bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr, X509_free);
  if (!leaf) return {};  // the TLS context has parsed it already; nothing else to say
  const std::string at = "--tls-cert " + cert_path + ": the certificate ";
  if (const ASN1_TIME* end = X509_get0_notAfter(leaf.get()); X509_cmp_current_time(end) < 0)
    return at + "expired (notAfter " + asn1_time_text(end) + "); TLS clients will refuse it";
  if (const ASN1_TIME* start = X509_get0_notBefore(leaf.get()); X509_cmp_current_time(start) > 0)
    return at + "is not valid before notBefore " + asn1_time_text(start) +
           " (is this machine's clock right?); TLS clients will refuse it until then";
  return {};
}

}  // namespace

TlsCredentials load_tls_credentials(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty())
    throw std::runtime_error("--tls-cert and --tls-key go together: give both or neither");
  if (files.cert.empty()) throw std::runtime_error("--tls-client-ca needs --tls-cert and --tls-key");
  TlsCredentials c{read_pem("--tls-cert", files.cert),
                   read_pem("--tls-key", files.key),
                   files.client_ca.empty() ? std::string() : read_pem("--tls-client-ca", files.client_ca),
                   {}};
  try {
    make_server_tls_context(c);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string(e.what()) + " (--tls-cert " + files.cert + ", --tls-key " +
                             files.key +
                             (files.client_ca.empty() ? "" : ", --tls-client-ca " + files.client_ca) + ")");
  }
  c.warning = validity_warning(files.cert, c.cert_chain_pem);
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
