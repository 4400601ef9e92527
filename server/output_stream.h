#pragma once
// One request's output on its way to the client, as vLLM's per-request incremental detokenizer: token ids
// pass through as they are sampled; text is decoded incrementally, ends before the first stop string, holds
// back what could still become one, and is sent in chunks that end on UTF-8 character boundaries.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"

namespace capserve::server {

class OutputStream {
 public:
  // A null `tokenizer` streams token ids, to which stop strings do not apply; `skip_special_tokens` false
  // decodes special tokens as their text.
  OutputStream(const runtime::Tokenizer* tokenizer, std::vector<std::string> stop_strings,
               bool skip_special_tokens = true);

  struct Chunk {
    std::string text;                   // to send now (text output)
    std::optional<std::int32_t> token;  // to send now (token output)
    bool stop = false;                  // a stop string was hit: nothing more is fed; finish() ends the text
  };
  Chunk feed(std::int32_t token);
  // What is still to send at a normal end: the held-back text and the decoder's remainder, or after a stop
  // string the unsent text before it.
  std::string finish();
  // Bytes of text generated so far and sent so far (chunks returned): a token's text is all sent once
  // sent_bytes() reaches what text_bytes() was after feeding it.
  [[nodiscard]] std::size_t text_bytes() const { return text_.size(); }
  [[nodiscard]] std::size_t sent_bytes() const { return sent_; }

 private:
  std::optional<runtime::IncrementalDecoder> decoder_;
  std::vector<std::string> stop_strings_;
  std::size_t longest_stop_ = 0;
  std::string text_;      // generated so far, cut before a stop string once one is hit
  std::size_t sent_ = 0;  // bytes of text_ already returned
  bool stopped_ = false;
};

}  // namespace capserve::server
