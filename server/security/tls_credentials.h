#pragma once
// The TLS material of --tls-cert / --tls-key / --tls-client-ca, read and checked once at start-up so that an
// unreadable file, a file that is not PEM, or a key that does not belong to the certificate stops the server
// with a message naming the flag and the file, before gRPC or the HTTP ports see it (gRPC alone would only
// say that it could not start). A certificate outside its validity period is served (the clock may be what is
// wrong) with a warning naming the flag, the file and the date, since every client will refuse it.
#include <memory>
#include <string>

namespace boost::asio::ssl {
class context;
}

namespace capserve::server::security {

struct TlsFiles {
  std::string cert;       // PEM certificate chain, leaf first
  std::string key;        // PEM private key of the leaf
  std::string client_ca;  // PEM CA bundle; when set, clients must present a certificate it signed (mTLS)
};

struct TlsCredentials {
  std::string cert_chain_pem;
  std::string private_key_pem;
  std::string client_ca_pem;  // empty: no client certificates asked for
  std::string warning;        // non-empty: the leaf certificate has expired or is not valid yet, and when
};

// Reads and checks the files. Throws std::runtime_error naming the flag and file on any problem.
TlsCredentials load_tls_credentials(const TlsFiles& files);

// A server-side TLS context (TLS 1.2 or newer) from checked credentials; with a client CA, a client without a
// certificate it signed fails the handshake. Throws std::runtime_error when OpenSSL refuses the material.
std::shared_ptr<boost::asio::ssl::context> make_server_tls_context(const TlsCredentials& credentials);

}  // namespace capserve::server::security
