// The API key check: only "Bearer <the key>" passes (scheme in any case, surrounding spaces ignored); the key
// file's first line is the key.
#include "server/security/api_key.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace capserve::server::security {
namespace {

TEST(ApiKey, AcceptsOnlyBearerWithTheKey) {
  const ApiKey key("sk-secret");
  EXPECT_TRUE(key.accepts("Bearer sk-secret"));
  EXPECT_TRUE(key.accepts("bearer sk-secret"));
  EXPECT_TRUE(key.accepts("BEARER  sk-secret "));
  EXPECT_FALSE(key.accepts(""));
  EXPECT_FALSE(key.accepts("sk-secret"));
  EXPECT_FALSE(key.accepts("Basic sk-secret"));
  EXPECT_FALSE(key.accepts("Bearer"));
  EXPECT_FALSE(key.accepts("Bearer "));
  EXPECT_FALSE(key.accepts("Bearer sk-secre"));
  EXPECT_FALSE(key.accepts("Bearer sk-secret2"));
  EXPECT_FALSE(key.accepts("Bearer SK-SECRET"));
}

TEST(ApiKey, EmptyKeyIsRefused) {
  EXPECT_THROW(ApiKey(""), std::invalid_argument);
}

TEST(ApiKey, FromFileReadsTheFirstLine) {
  const auto path = std::filesystem::temp_directory_path() / "capserve_test_api_key.txt";
  std::ofstream(path) << "  sk-from-file \nsecond line\n";
  EXPECT_TRUE(ApiKey::from_file(path.string()).accepts("Bearer sk-from-file"));
  std::ofstream(path) << "\n";
  EXPECT_THROW(ApiKey::from_file(path.string()), std::runtime_error);
  std::filesystem::remove(path);
  try {
    ApiKey::from_file(path.string());
    FAIL() << "a missing file must throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace capserve::server::security
