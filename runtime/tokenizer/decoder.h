#pragma once
// The tokenizer.json "decoder", run as a stream so that full and incremental decoding are one code path and
// always agree. Supported chains (Sequence flattened):
//   ByteLevel                                   GPT-2/Qwen/DeepSeek style
//   (Replace | Metaspace)* [ByteFallback] with Fuse and at most one Strip in any order after them
//                                               Llama/Mistral style: Replace ▁→' ', ByteFallback, Fuse, Strip
//   null (no decoder)                           tokens joined with spaces, as HF does
// Each matches HF's decode_chain exactly. Streaming holds back only what later tokens can still change: an
// unfinished UTF-8 sequence (ByteLevel), an open run of <0xXX> tokens (ByteFallback turns an invalid run into
// one U+FFFD per byte) and trailing Strip characters.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/tokenizer/json_at.h"

namespace capserve::runtime {

struct DecodeState {
  std::string out;            // text produced, appended to by feed() and finish()
  std::string pending_bytes;  // ByteLevel: unfinished UTF-8 tail; ByteFallback: the open run of byte tokens
  std::string held;           // Strip after Fuse: trailing strip characters not yet known to be interior
  std::size_t tokens = 0;     // tokens passed to the decoder so far
  std::int64_t strip_left =
      -1;  // Strip after Fuse: leading characters still to drop; -1 before the first token
};

class Decoder {
 public:
  // `tokens[id]` is the token of each id (nullopt where no token has that id), `special[id]` whether it is a
  // special added token.
  static Decoder from_json(const std::optional<JsonAt>& spec,
                           const std::vector<std::optional<std::string>>& tokens,
                           const std::vector<bool>& special);

  void feed(DecodeState& state, std::int32_t id, bool skip_special_tokens) const;
  void finish(DecodeState& state) const;

 private:
  enum class Mode { byte_level, pieces, join_with_spaces };
  struct TokenOp {
    enum class Kind { replace, metaspace } kind;
    std::string from;  // replace: pattern; metaspace: replacement character
    std::string to;    // replace: content
    bool strip_first =
        false;  // metaspace: drop the replacement from the first token (prepend_scheme != never)
  };
  struct Strip {
    std::string content;  // one character
    std::int64_t start = 0;
    std::int64_t stop = 0;
    bool fused = false;  // after Fuse: applies to the whole text, else to each token
  };
  struct Piece {
    std::string text;
    std::int16_t byte = -1;  // ByteFallback: the byte a <0xXX> token stands for
  };

  void add_step(const JsonAt& spec, std::vector<JsonAt>& chain);
  void compile(const std::vector<JsonAt>& chain);
  [[nodiscard]] Piece make_piece(const std::string& token, bool first) const;
  void emit(DecodeState& state, std::string_view text) const;
  void flush_byte_run(DecodeState& state) const;

  Mode mode_ = Mode::join_with_spaces;
  std::vector<TokenOp> ops_;
  bool byte_fallback_ = false;
  std::optional<Strip> strip_;
  bool position_dependent_ = false;  // a Metaspace op treats the first token differently
  std::vector<bool> present_;
  std::vector<bool> special_;
  std::vector<Piece> rest_;   // each id as any token but the first
  std::vector<Piece> first_;  // each id as the first token, when position_dependent_
};

}  // namespace capserve::runtime
