#pragma once
// The shared secret of --api-key / --api-key-file: HTTP requests carry it as `Authorization: Bearer KEY`,
// gRPC calls as the metadata `authorization: Bearer KEY`. The check compares SHA-256 digests in constant
// time, so neither the key's length nor the position of the first wrong byte shows in the answer's timing.
#include <array>
#include <string>
#include <string_view>

namespace capserve::server::security {

class ApiKey {
 public:
  // Throws std::invalid_argument for an empty key.
  explicit ApiKey(std::string_view key);

  // The key from the file's first line (surrounding whitespace dropped). Throws std::runtime_error naming the
  // file when it cannot be read or holds no key.
  static ApiKey from_file(const std::string& path);

  // Whether an Authorization value ("Bearer KEY"; the scheme in any case) carries the key.
  [[nodiscard]] bool accepts(std::string_view authorization) const;

 private:
  std::array<unsigned char, 32> digest_{};
};

}  // namespace capserve::server::security
