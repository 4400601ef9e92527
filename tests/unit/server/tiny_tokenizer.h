#pragma once
// The committed capserve-moe-tiny tokenizer (deploy/models), for server tests that need real text.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string_view>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"

namespace capserve::server {

inline runtime::Tokenizer load_tiny_tokenizer() {
  return runtime::Tokenizer::load(std::filesystem::path(CAPSERVE_SOURCE_DIR) /
                                  "deploy/models/capserve-moe-tiny");
}

// The one token that spells `text`.
inline std::int32_t single_token(const runtime::Tokenizer& tokenizer, std::string_view text) {
  std::vector<std::int32_t> ids;
  EXPECT_TRUE(tokenizer.encode(text, false, ids).ok());
  EXPECT_EQ(ids.size(), 1U) << text;
  return ids.at(0);
}

}  // namespace capserve::server
