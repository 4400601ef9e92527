#include "server/security/api_key.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <stdexcept>

namespace capserve::server::security {
namespace {

std::array<unsigned char, 32> sha256(std::string_view text) {
  std::array<unsigned char, 32> digest{};
  static_assert(digest.size() == SHA256_DIGEST_LENGTH);
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

std::string_view trim(std::string_view s) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace

ApiKey::ApiKey(std::string_view key) : digest_(sha256(key)) {
  if (key.empty()) throw std::invalid_argument("the API key is empty");
}

ApiKey ApiKey::from_file(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line))
    throw std::runtime_error("--api-key-file " + path + ": cannot read a line");
  const std::string_view key = trim(line);
  if (key.empty()) throw std::runtime_error("--api-key-file " + path + ": the first line holds no key");
  return ApiKey(key);
}

bool ApiKey::accepts(std::string_view authorization) const {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() < kScheme.size() ||
      !std::equal(kScheme.begin(), kScheme.end(), authorization.begin(),
                  [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); }))
    return false;
  const auto presented = sha256(trim(authorization.substr(kScheme.size())));
  return CRYPTO_memcmp(presented.data(), digest_.data(), digest_.size()) == 0;
}

}  // namespace capserve::server::security
