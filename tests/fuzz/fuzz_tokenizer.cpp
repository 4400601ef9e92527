// libFuzzer target for the tokenizer: arbitrary bytes as text to encode (then decode, batch and streaming)
// and as token ids to decode, on every supported tokenizer kind. It checks what must hold for any input: no
// crash or sanitizer report, invalid UTF-8 refused and valid UTF-8 accepted, decoded text always UTF-8, and
// streaming decode equal to full decode.
//
// Build (clang++ with libFuzzer; not part of the default build) and run, from the repository root:
//   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCAPSERVE_FUZZ=ON
//   ninja -C build-fuzz fuzz_tokenizer
//   mkdir -p build-fuzz/fuzz-corpus
//   build-fuzz/tests/fuzz/fuzz_tokenizer -max_total_time=600 -max_len=4096 build-fuzz/fuzz-corpus
// The first input byte picks the tokenizer and whether the rest is text or ids.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"
#include "runtime/tokenizer/utf8.h"

namespace {

using capserve::runtime::IncrementalDecoder;
using capserve::runtime::Tokenizer;
namespace utf8 = capserve::runtime::utf8;

std::vector<std::unique_ptr<Tokenizer>>& tokenizers() {
  static std::vector<std::unique_ptr<Tokenizer>> all;
  return all;
}

void check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_tokenizer: %s\n", what);
    std::abort();
  }
}

void decode_both_ways(const Tokenizer& t, const std::vector<std::int32_t>& ids, bool skip) {
  const std::string full = t.decode(ids, skip);
  check(utf8::is_valid(full), "decode gave invalid UTF-8");
  IncrementalDecoder decoder(t, skip);
  std::string streamed;
  for (const std::int32_t id : ids) {
    const std::string_view chunk = decoder.feed(id);
    check(utf8::is_valid(chunk), "streaming decode gave invalid UTF-8");
    streamed += chunk;
  }
  streamed += decoder.finish();
  check(streamed == full, "streaming decode differs from decode");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::filesystem::path shared = CAPSERVE_SHARED_DATA_DIR "/tokenizers";
  const std::filesystem::path synthetic = CAPSERVE_FIXTURES_DIR "/tokenizers/synthetic";
  for (const auto& dir :
       {shared / "qwen3", shared / "deepseek_v3", shared / "llama2", synthetic / "bytelevel",
        synthetic / "metaspace", synthetic / "split", synthetic / "nodecoder", synthetic / "strip"}) {
    tokenizers().push_back(std::make_unique<Tokenizer>(Tokenizer::load(dir)));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const Tokenizer& t = *tokenizers()[data[0] % tokenizers().size()];
  const bool as_ids = (data[0] / tokenizers().size()) % 2 == 1;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (as_ids) {
    std::vector<std::int32_t> ids(rest.size() / 4);
    if (!ids.empty()) std::memcpy(ids.data(), rest.data(), ids.size() * 4);
    // Mostly ids in range, some not.
    for (std::int32_t& id : ids) {
      if (id % 8 != 0) id = static_cast<std::int32_t>(static_cast<std::uint32_t>(id) % (t.vocab_size() + 2U));
    }
    decode_both_ways(t, ids, false);
    decode_both_ways(t, ids, true);
    return 0;
  }
  std::vector<std::int32_t> ids;
  const bool ok = t.encode(rest, (data[0] & 0x80) != 0, ids).ok();
  check(ok == utf8::is_valid(rest), "encode accepted invalid or refused valid UTF-8");
  if (ok) {
    for (const std::int32_t id : ids) check(id >= 0 && id < t.vocab_size(), "encode gave an id out of range");
    decode_both_ways(t, ids, false);
  }
  return 0;
}
