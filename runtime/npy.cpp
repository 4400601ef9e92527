#include "runtime/npy.h"

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "runtime/load_error.h"

namespace capserve::runtime {

void write_npy(const std::filesystem::path& path, std::span<const float> data,
               std::span<const std::int64_t> shape) {
  std::string dims;
  for (const std::int64_t d : shape) dims += std::to_string(d) + ", ";
  if (shape.size() > 1) dims.resize(dims.size() - 2);  // (n,) keeps its comma
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Pad with spaces so the data starts on a 64-byte boundary, newline-terminated.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) throw LoadError("cannot write " + path.string());
  const auto len = static_cast<std::uint16_t>(header.size());
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.write(magic, 8);
  const char len_bytes[2] = {static_cast<char>(len & 0xFF), static_cast<char>(len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size_bytes()));
  if (!out) throw LoadError("failed writing " + path.string());
}

NpyArray read_npy(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw LoadError("cannot open " + path.string());
  const auto fail = [&](const std::string& why) -> LoadError {
    return LoadError(path.string() + ": " + why);
  };
  unsigned char pre[8];
  if (!in.read(reinterpret_cast<char*>(pre), 8) || std::memcmp(pre, "\x93NUMPY", 6) != 0)
    throw fail("not an .npy file");
  std::uint32_t header_len = 0;
  if (pre[6] == 1) {
    unsigned char b[2];
    if (!in.read(reinterpret_cast<char*>(b), 2)) throw fail("truncated header");
    header_len = b[0] | (b[1] << 8);
  } else if (pre[6] == 2 || pre[6] == 3) {
    unsigned char b[4];
    if (!in.read(reinterpret_cast<char*>(b), 4)) throw fail("truncated header");
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
  } else {
    throw fail("unsupported .npy version");
  }
  if (header_len > (1U << 20)) throw fail("header too large");
  std::string header(header_len, '\0');
  if (!in.read(header.data(), header_len)) throw fail("truncated header");
  if (header.find("'descr': '<f4'") == std::string::npos)
    throw fail("dtype is not little-endian float32 ('<f4')");
  if (header.find("'fortran_order': False") == std::string::npos)
    throw fail("Fortran-order arrays are not supported");
  const std::size_t key = header.find("'shape':");
  const std::size_t open = header.find('(', key);
  const std::size_t close = header.find(')', open);
  if (key == std::string::npos || open == std::string::npos || close == std::string::npos)
    throw fail("no shape in header");
  NpyArray a;
  std::int64_t count = 1;
  std::istringstream dims(header.substr(open + 1, close - open - 1));
  std::string dim;
  while (std::getline(dims, dim, ',')) {
    if (dim.find_first_not_of(' ') == std::string::npos) continue;  // the trailing comma of (n,)
    std::size_t used = 0;
    std::int64_t d = -1;
    try {
      d = std::stoll(dim, &used);
    } catch (const std::exception&) {
      d = -1;
    }
    if (d < 0 || dim.find_first_not_of(' ', used) != std::string::npos) throw fail("bad shape in header");
    a.shape.push_back(d);
    count *= d;
  }
  a.data.resize(static_cast<std::size_t>(count));
  if (!in.read(reinterpret_cast<char*>(a.data.data()), static_cast<std::streamsize>(count * 4))) {
    throw fail("data shorter than its shape");
  }
  return a;
}

}  // namespace capserve::runtime
