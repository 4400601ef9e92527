#pragma once
// Text <-> token ids with a Hugging Face tokenizer directory (tokenizer.json, optional
// tokenizer_config.json), giving the ids and text of HF `tokenizers` for the byte-level BPE
// (GPT-2/Qwen/DeepSeek/OLMoE) and Metaspace/byte-fallback BPE (Llama/Mistral/Mixtral) families. Components
// outside what those files use are a LoadError naming the component, never silently approximated.
//
// Invalid UTF-8 is refused by encode() with a Status: HF cannot be given such input at all (its Python API
// takes str), so there is no behaviour to match; decode() never fails (bytes that do not form UTF-8 come out
// as U+FFFD, as in HF).
//
// A Tokenizer is immutable and cheap to copy; encode() and decode() may run concurrently from any threads.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/status.h"
#include "runtime/text_range.h"

namespace capserve::runtime {

struct TokenizerCore;

class Tokenizer {
 public:
  // Throws LoadError naming the file and JSON key at fault.
  static Tokenizer load(const std::filesystem::path& dir);

  // Replaces `ids` with the ids of `text`; with `add_special_tokens`, the post-processor's tokens (e.g. BOS)
  // are added as HF does. Fails with invalid_argument for text that is not UTF-8 (naming the byte offset).
  // Special added tokens (e.g. <|endoftext|>) spelled inside a range of `plain_text` (sorted byte ranges of
  // `text`, e.g. chat message content) are not matched: that text is tokenized as ordinary text, as HF does
  // with split_special_tokens, while the rest of `text` keeps its special tokens. Special tokens that match
  // on normalized text are kept out of every piece between raw added tokens that overlaps a range.
  Status encode(std::string_view text, bool add_special_tokens, std::vector<std::int32_t>& ids,
                std::span<const TextRange> plain_text = {}) const;

  // HF's decode(ids, skip_special_tokens). Ids without a token are ignored, as in HF.
  [[nodiscard]] std::string decode(std::span<const std::int32_t> ids, bool skip_special_tokens) const;

  // One past the largest token id (model vocabulary and added tokens).
  [[nodiscard]] std::int32_t vocab_size() const;
  [[nodiscard]] std::optional<std::int32_t> token_to_id(std::string_view token) const;
  // The token as spelled in tokenizer.json (byte-level tokens in their character spelling, e.g. "Ġthe").
  [[nodiscard]] std::optional<std::string_view> id_to_token(std::int32_t id) const;
  // Whether the id is a special added token (skipped by decode with skip_special_tokens).
  [[nodiscard]] bool is_special(std::int32_t id) const;

  // From tokenizer_config.json, when present there.
  [[nodiscard]] std::optional<std::int32_t> bos_id() const;
  [[nodiscard]] std::optional<std::int32_t> eos_id() const;
  [[nodiscard]] std::optional<std::int32_t> pad_id() const;

 private:
  friend class IncrementalDecoder;
  explicit Tokenizer(std::shared_ptr<const TokenizerCore> core) : core_(std::move(core)) {}
  std::shared_ptr<const TokenizerCore> core_;
};

// Streaming decode: feed ids one at a time and get the text each completes. Never returns part of a UTF-8
// sequence, and the concatenation of everything feed() and finish() return equals
// Tokenizer::decode(all ids, skip_special_tokens).
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  ~IncrementalDecoder();
  IncrementalDecoder(IncrementalDecoder&&) noexcept;
  IncrementalDecoder& operator=(IncrementalDecoder&&) noexcept;

  // The text completed by `id`; the view is valid until the next call.
  std::string_view feed(std::int32_t id);
  // The text still held back at the end of the stream (an unfinished UTF-8 sequence comes out as U+FFFD).
  // Afterwards the decoder starts a new stream.
  std::string_view finish();

 private:
  struct State;
  std::shared_ptr<const TokenizerCore> core_;
  bool skip_special_tokens_;
  std::unique_ptr<State> state_;
};

}  // namespace capserve::runtime
