#pragma once
// This process's figures from /proc/self/status, for the programs' reports of their own memory.
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

namespace capserve::runtime {

// A "Field:   123 kB" line of /proc/self/status (field with its colon, e.g. "VmRSS:"), in KiB; 0 when absent.
inline std::int64_t self_status_kib(std::string_view field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with(field)) return std::stoll(line.substr(field.size()));
  }
  return 0;
}

}  // namespace capserve::runtime
