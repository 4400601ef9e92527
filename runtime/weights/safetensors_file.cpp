#include "runtime/weights/safetensors_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "runtime/load_error.h"

namespace capserve::runtime {

namespace {

// The reference implementation refuses headers above 100 MB; a real header is a few hundred kilobytes at
// most.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::size_t kLengthPrefixBytes = 8;
constexpr std::string_view kMetadataKey = "__metadata__";

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what) {
  throw LoadError("safetensors file " + path.string() + ": " + what);
}

[[noreturn]] void fail_tensor(const std::filesystem::path& path, const std::string& name,
                              const std::string& what) {
  fail(path, "tensor '" + name + "': " + what);
}

std::string errno_text(int err) {
  return std::strerror(err);
}

// Closes a file descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const { return fd_; }

 private:
  int fd_;
};

std::string json_type(const nlohmann::json& j) {
  return j.type_name();
}

struct Entry {
  TensorInfo info;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

// Validates one tensor entry of the header and returns its description; `data` is the start of the data
// section.
Entry parse_entry(const std::filesystem::path& path, const std::string& name, const nlohmann::json& value,
                  const std::byte* data, std::uint64_t data_size) {
  if (!value.is_object()) fail_tensor(path, name, "entry must be a JSON object, got " + json_type(value));

  const auto dtype_it = value.find("dtype");
  if (dtype_it == value.end()) fail_tensor(path, name, "missing \"dtype\"");
  if (!dtype_it->is_string())
    fail_tensor(path, name, "\"dtype\" must be a string, got " + json_type(*dtype_it));
  const auto& dtype_str = dtype_it->get_ref<const std::string&>();
  const auto dtype = kernels::parse_dtype(dtype_str);
  if (!dtype) {
    fail_tensor(path, name, "unsupported dtype '" + dtype_str + "' (supported: F32, F16, BF16, F8_E4M3)");
  }

  const auto shape_it = value.find("shape");
  if (shape_it == value.end()) fail_tensor(path, name, "missing \"shape\"");
  if (!shape_it->is_array())
    fail_tensor(path, name, "\"shape\" must be an array, got " + json_type(*shape_it));
  std::vector<std::int64_t> shape;
  shape.reserve(shape_it->size());
  std::uint64_t numel = 1;
  bool overflow = false;
  for (const auto& dim : *shape_it) {
    if (!dim.is_number_integer()) {
      fail_tensor(path, name, "\"shape\" entries must be integers, got " + json_type(dim));
    }
    std::int64_t d = 0;
    if (dim.is_number_unsigned()) {
      const auto u = dim.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        fail_tensor(path, name, "shape dimension " + std::to_string(u) + " is too large");
      }
      d = static_cast<std::int64_t>(u);
    } else {
      d = dim.get<std::int64_t>();
      if (d < 0) fail_tensor(path, name, "negative shape dimension " + std::to_string(d));
    }
    shape.push_back(d);
    std::uint64_t next = 0;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &next)) overflow = true;
    numel = next;
  }
  // A zero dimension makes the tensor empty whatever the other dimensions are.
  const bool has_zero = std::find(shape.begin(), shape.end(), 0) != shape.end();
  if (has_zero) {
    numel = 0;
    overflow = false;
  }
  std::uint64_t nbytes = 0;
  if (overflow ||
      __builtin_mul_overflow(numel, static_cast<std::uint64_t>(kernels::dtype_size(*dtype)), &nbytes)) {
    fail_tensor(path, name, "shape " + shape_text(shape) + " overflows the byte size");
  }

  const auto offs_it = value.find("data_offsets");
  if (offs_it == value.end()) fail_tensor(path, name, "missing \"data_offsets\"");
  if (!offs_it->is_array() || offs_it->size() != 2) {
    fail_tensor(path, name, "\"data_offsets\" must be an array [begin, end]");
  }
  std::uint64_t offs[2] = {0, 0};
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& o = (*offs_it)[i];
    if (!o.is_number_integer()) {
      fail_tensor(path, name, "\"data_offsets\" entries must be integers, got " + json_type(o));
    }
    if (!o.is_number_unsigned()) {
      fail_tensor(path, name, "negative \"data_offsets\" entry " + std::to_string(o.get<std::int64_t>()));
    }
    offs[i] = o.get<std::uint64_t>();
  }
  const std::uint64_t begin = offs[0];
  const std::uint64_t end = offs[1];
  const std::string range = "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
  if (begin > end) fail_tensor(path, name, "data_offsets " + range + " has begin > end");
  if (end > data_size) {
    fail_tensor(
        path, name,
        "data_offsets " + range + " end beyond the data section of " + std::to_string(data_size) + " bytes");
  }
  if (end - begin != nbytes) {
    fail_tensor(path, name,
                "shape " + shape_text(shape) + " x " + std::string(kernels::dtype_name(*dtype)) + " (" +
                    std::to_string(kernels::dtype_size(*dtype)) + " bytes) = " + std::to_string(nbytes) +
                    " bytes, but data_offsets " + range + " span " + std::to_string(end - begin) + " bytes");
  }

  Entry e;
  e.info.name = name;
  e.info.dtype = *dtype;
  e.info.shape = std::move(shape);
  e.info.data = data + begin;
  e.info.nbytes = static_cast<std::size_t>(nbytes);
  e.begin = begin;
  e.end = end;
  return e;
}

void check_metadata(const std::filesystem::path& path, const nlohmann::json& value) {
  if (!value.is_object()) fail(path, "\"__metadata__\" must be an object, got " + json_type(value));
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      fail(path, "\"__metadata__\" value for '" + key + "' must be a string, got " + json_type(v));
    }
  }
}

}  // namespace

// A read-only private mapping of a whole file, unmapped on destruction.
struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  std::size_t size = 0;

  Mapping(void* a, std::size_t s) : addr(a), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr != nullptr && addr != MAP_FAILED) ::munmap(addr, size);
  }
  [[nodiscard]] const std::byte* bytes() const { return static_cast<const std::byte*>(addr); }
};

SafetensorsFile::SafetensorsFile(std::filesystem::path path, std::unique_ptr<Mapping> mapping,
                                 std::vector<TensorInfo> tensors)
    : path_(std::move(path)), mapping_(std::move(mapping)), tensors_(std::move(tensors)) {}

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  const Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(path, "cannot open: " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, "cannot stat: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < kLengthPrefixBytes) {
    fail(path, "file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  }
  if (file_size > std::numeric_limits<std::size_t>::max()) fail(path, "file too large to map");

  void* addr = ::mmap(nullptr, static_cast<std::size_t>(file_size), PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (addr == MAP_FAILED) fail(path, "cannot mmap: " + errno_text(errno));
  auto mapping = std::make_unique<Mapping>(addr, static_cast<std::size_t>(file_size));
  const std::byte* base = mapping->bytes();

  std::uint64_t header_size = 0;
  for (std::size_t i = 0; i < kLengthPrefixBytes; ++i) {
    header_size |= static_cast<std::uint64_t>(std::to_integer<unsigned>(base[i])) << (8 * i);
  }
  if (header_size > file_size - kLengthPrefixBytes) {
    fail(path, "header length " + std::to_string(header_size) + " exceeds the " +
                   std::to_string(file_size - kLengthPrefixBytes) + " bytes after the length prefix");
  }
  if (header_size > kMaxHeaderBytes) {
    fail(path, "header length " + std::to_string(header_size) + " exceeds the limit of " +
                   std::to_string(kMaxHeaderBytes) + " bytes");
  }

  const auto* header_begin = reinterpret_cast<const char*>(base + kLengthPrefixBytes);
  const auto* header_end = header_begin + header_size;
  // nlohmann stops at a NUL byte as if the input ended there; strict JSON has no raw NUL anywhere.
  if (std::memchr(header_begin, '\0', static_cast<std::size_t>(header_size)) != nullptr) {
    fail(path, "header is not valid JSON (contains a NUL byte)");
  }
  // nlohmann keeps the last of duplicated keys; catch duplicated top-level names (tensors or __metadata__)
  // here.
  std::vector<std::string> top_keys;
  const nlohmann::json::parser_callback_t on_event =
      [&top_keys](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        if (event == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string()) {
          top_keys.push_back(parsed.get<std::string>());
        }
        return true;
      };
  const auto header = nlohmann::json::parse(header_begin, header_end, on_event, /*allow_exceptions=*/false);
  if (header.is_discarded()) fail(path, "header is not valid JSON");
  if (!header.is_object()) fail(path, "header must be a JSON object, got " + json_type(header));
  std::sort(top_keys.begin(), top_keys.end());
  if (const auto dup = std::adjacent_find(top_keys.begin(), top_keys.end()); dup != top_keys.end()) {
    fail(path, "header lists '" + *dup + "' more than once");
  }

  const std::byte* data = base + kLengthPrefixBytes + header_size;
  const std::uint64_t data_size = file_size - kLengthPrefixBytes - header_size;

  std::vector<Entry> entries;
  entries.reserve(header.size());
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      check_metadata(path, value);
      continue;
    }
    entries.push_back(parse_entry(path, key, value, data, data_size));
  }

  // Overlap check over non-empty ranges sorted by start: each must start at or after the previous one's end.
  std::vector<const Entry*> by_offset;
  by_offset.reserve(entries.size());
  for (const auto& e : entries) {
    if (e.end > e.begin) by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->info.name < b->info.name;
  });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const Entry& prev = *by_offset[i - 1];
    const Entry& cur = *by_offset[i];
    if (cur.begin < prev.end) {
      fail(path, "tensors '" + prev.info.name + "' [" + std::to_string(prev.begin) + ", " +
                     std::to_string(prev.end) + ") and '" + cur.info.name + "' [" +
                     std::to_string(cur.begin) + ", " + std::to_string(cur.end) + ") overlap");
    }
  }

  std::vector<TensorInfo> tensors;
  tensors.reserve(entries.size());
  for (auto& e : entries) tensors.push_back(std::move(e.info));
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return SafetensorsFile(path, std::move(mapping), std::move(tensors));
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                   [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  if (it == tensors_.end() || it->name != name) return nullptr;
  return &*it;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace capserve::runtime
