#include "server/output_stream.h"

#include <algorithm>
#include <utility>

#include "runtime/tokenizer/utf8.h"

namespace capserve::server {

OutputStream::OutputStream(const runtime::Tokenizer* tokenizer, std::vector<std::string> stop_strings,
                           bool skip_special_tokens)
    : stop_strings_(std::move(stop_strings)) {
  if (tokenizer != nullptr) decoder_.emplace(*tokenizer, skip_special_tokens);
  for (const std::string& stop : stop_strings_) longest_stop_ = std::max(longest_stop_, stop.size());
}

OutputStream::Chunk OutputStream::feed(std::int32_t token) {
  Chunk chunk;
  if (!decoder_) {
    chunk.token = token;
    return chunk;
  }
  text_ += decoder_->feed(token);
  for (const std::string& stop : stop_strings_) {
    // Only a match that reaches into unsent text is new: earlier text was searched when it came.
    const std::size_t from = sent_ >= stop.size() ? sent_ - stop.size() + 1 : 0;
    const std::size_t at = text_.find(stop, from);
    if (at != std::string::npos) {
      text_.resize(at);
      stopped_ = true;  // what the decoder still holds comes after the stop string
      chunk.stop = true;
      return chunk;
    }
  }
  // Text that could still become a stop string is held back.
  std::size_t safe =
      text_.size() >= longest_stop_ ? text_.size() - (longest_stop_ > 0 ? longest_stop_ - 1 : 0) : 0;
  // The hold-back is counted in bytes; a chunk must still end on a character boundary (protobuf refuses to
  // send a string field that is not UTF-8).
  while (safe > sent_ && safe < text_.size() && runtime::utf8::is_continuation(text_[safe])) --safe;
  if (safe > sent_) {
    chunk.text = text_.substr(sent_, safe - sent_);
    sent_ = safe;
  }
  return chunk;
}

std::string OutputStream::finish() {
  if (decoder_ && !stopped_) text_ += decoder_->finish();
  std::string rest = text_.size() > sent_ ? text_.substr(sent_) : std::string();
  sent_ = text_.size();
  return rest;
}

}  // namespace capserve::server
