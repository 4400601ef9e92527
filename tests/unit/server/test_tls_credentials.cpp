// Start-up checks of the TLS files: each problem names the flag and the file, and a key of another pair is
// refused; an expired or not yet valid certificate is accepted with a warning naming the flag, the file and
// the date. The certificates are made here with OpenSSL (a self-signed P-256 certificate per key).
#include "server/security/tls_credentials.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>

namespace capserve::server::security {
namespace {

namespace fs = std::filesystem;

struct Pem {
  std::string key, cert;
};

std::string to_pem(auto write) {
  const std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
  EXPECT_EQ(write(bio.get()), 1);
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return {data, static_cast<std::size_t>(size)};
}

// Valid from now + `not_before_s` to now + `not_after_s`.
Pem self_signed(long not_before_s = 0, long not_after_s = 3600) {
  const std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  const std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), X509_free);
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), not_before_s);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), not_after_s);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("localhost"),
                             -1, -1, 0);
  X509_set_issuer_name(cert.get(), name);
  X509_set_pubkey(cert.get(), key.get());
  EXPECT_GT(X509_sign(cert.get(), key.get(), EVP_sha256()), 0);
  return {to_pem([&](BIO* b) {
            return PEM_write_bio_PrivateKey(b, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
          }),
          to_pem([&](BIO* b) { return PEM_write_bio_X509(b, cert.get()); })};
}

class TlsCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("capserve_tls_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    const auto path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }

  // The message load_tls_credentials throws, or "" when it accepts the files.
  static std::string refusal(const TlsFiles& files) {
    try {
      load_tls_credentials(files);
      return "";
    } catch (const std::runtime_error& e) {
      return e.what();
    }
  }

  fs::path dir_;
};

TEST_F(TlsCredentialsTest, MatchingPairAndClientCaAreAccepted) {
  const Pem a = self_signed();
  const TlsFiles files{write("a.pem", a.cert), write("a.key", a.key), write("ca.pem", a.cert)};
  const TlsCredentials c = load_tls_credentials(files);
  EXPECT_EQ(c.cert_chain_pem, a.cert);
  EXPECT_EQ(c.private_key_pem, a.key);
  EXPECT_EQ(c.client_ca_pem, a.cert);
  EXPECT_NE(make_server_tls_context(c), nullptr);
}

TEST_F(TlsCredentialsTest, KeyOfAnotherPairIsRefused) {
  const Pem a = self_signed(), b = self_signed();
  const std::string why = refusal({write("a.pem", a.cert), write("b.key", b.key), ""});
  EXPECT_NE(why.find("does not match the certificate"), std::string::npos) << why;
  EXPECT_NE(why.find("b.key"), std::string::npos) << why;
}

TEST_F(TlsCredentialsTest, UnreadableAndNonPemFilesAreNamed) {
  const Pem a = self_signed();
  const std::string missing = (dir_ / "missing.pem").string();
  std::string why = refusal({missing, write("a.key", a.key), ""});
  EXPECT_NE(why.find("--tls-cert " + missing + ": cannot read"), std::string::npos) << why;
  const std::string text = write("text.key", "not a key\n");
  why = refusal({write("a.pem", a.cert), text, ""});
  EXPECT_NE(why.find("--tls-key " + text + ": not a PEM file"), std::string::npos) << why;
  const std::string broken =
      write("broken.pem", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
  why = refusal({write("a.pem", a.cert), write("a.key", a.key), broken});
  EXPECT_NE(why.find("client CA bundle is not valid PEM"), std::string::npos) << why;
  why = refusal({write("a.pem", a.cert), "", ""});
  EXPECT_NE(why.find("go together"), std::string::npos) << why;
}

TEST_F(TlsCredentialsTest, CertificateOutsideItsValidityIsAcceptedWithAWarning) {
  constexpr long kDay = 24 * 3600;
  const Pem valid = self_signed();
  EXPECT_EQ(load_tls_credentials({write("valid.pem", valid.cert), write("valid.key", valid.key), ""}).warning,
            "");
  const Pem expired = self_signed(-2 * kDay, -kDay);
  const std::string expired_pem = write("expired.pem", expired.cert);
  std::string warning = load_tls_credentials({expired_pem, write("expired.key", expired.key), ""}).warning;
  EXPECT_NE(warning.find("--tls-cert " + expired_pem + ": the certificate expired"), std::string::npos)
      << warning;
  EXPECT_NE(warning.find("notAfter "), std::string::npos) << warning;
  EXPECT_NE(warning.find(" GMT"), std::string::npos) << warning;  // the date as OpenSSL prints it
  const Pem early = self_signed(kDay, 2 * kDay);
  const std::string early_pem = write("early.pem", early.cert);
  warning = load_tls_credentials({early_pem, write("early.key", early.key), ""}).warning;
  EXPECT_NE(warning.find("--tls-cert " + early_pem + ": the certificate is not valid before"),
            std::string::npos)
      << warning;
  EXPECT_NE(warning.find("notBefore "), std::string::npos) << warning;
}

}  // namespace
}  // namespace capserve::server::security
