#include "runtime/tokenizer/tokenizer.h"

#include <cstdio>

#include "runtime/tokenizer/tokenizer_core.h"
#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime {
namespace {

// The encode pipeline, HF's encode_single_sequence: added tokens found in the raw text, the rest normalized,
// normalized added tokens found in that, the rest pre-tokenized into words, each word encoded by BPE.
class Encoder final : public PieceSink, public WordSink {
 public:
  Encoder(const TokenizerCore& core, EncodeWorkspace& workspace, std::string_view text,
          std::span<const TextRange> plain_text, std::vector<std::int32_t>& ids)
      : core_(core), workspace_(workspace), text_(text), plain_text_(plain_text), ids_(ids) {}

  Status run() {
    core_.raw_added_tokens.split(text_, *this, plain_text_);
    return status_;
  }

  void piece(std::string_view piece, std::int32_t added_token_id) override {
    if (added_token_id >= 0) {
      ids_.push_back(added_token_id);
      return;
    }
    if (!status_.ok() || piece.empty()) return;
    if (normalized_.data() != nullptr) {  // a piece of normalized text
      pre_tokenize(piece, normalized_at_start_ && piece.data() == normalized_.data());
      return;
    }
    const bool at_start = piece.data() == text_.data();
    if (core_.normalizer.is_identity()) {
      normalized_ = piece;
    } else {
      core_.normalizer.normalize(piece, workspace_.normalized, workspace_.normalizer);
      normalized_ = workspace_.normalized;
    }
    if (core_.normalized_added_tokens.empty()) {
      pre_tokenize(normalized_, at_start);
    } else {
      normalized_at_start_ = at_start;
      // Normalization moves offsets: a piece that holds plain text is plain text as a whole here.
      const auto begin = static_cast<std::size_t>(piece.data() - text_.data());
      const bool plain = overlaps_any(plain_text_, begin, begin + piece.size());
      const TextRange whole{0, normalized_.size()};
      core_.normalized_added_tokens.split(
          normalized_, *this, plain ? std::span<const TextRange>(&whole, 1) : std::span<const TextRange>());
    }
    normalized_ = {};
  }

  void word(std::string_view word) override { core_.model.encode_word(word, workspace_.bpe, ids_); }

 private:
  void pre_tokenize(std::string_view text, bool at_start) {
    if (status_.ok()) status_ = core_.pre_tokenizer.run(text, at_start, workspace_.pre_tokenizer, *this);
  }

  const TokenizerCore& core_;
  EncodeWorkspace& workspace_;
  std::string_view text_;
  std::span<const TextRange> plain_text_;
  std::vector<std::int32_t>& ids_;
  std::string_view normalized_;  // set while splitting a normalized piece on the normalized added tokens
  bool normalized_at_start_ = false;
  Status status_;
};

}  // namespace

Tokenizer Tokenizer::load(const std::filesystem::path& dir) {
  return Tokenizer(load_tokenizer_core(dir));
}

Status Tokenizer::encode(std::string_view text, bool add_special_tokens, std::vector<std::int32_t>& ids,
                         std::span<const TextRange> plain_text) const {
  ids.clear();
  const std::size_t valid = utf8::valid_prefix_length(text);
  if (valid != text.size()) {
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02X",
                  static_cast<unsigned>(static_cast<unsigned char>(text[valid])));
    return Status::invalid_argument("text is not valid UTF-8 (ill-formed byte " + std::string(byte) +
                                    " at offset " + std::to_string(valid) + ")");
  }
  const WorkspacePool::Lease workspace = core_->workspaces.acquire();
  if (add_special_tokens) ids = core_->post_processor.prefix();
  Status status = Encoder(*core_, *workspace, text, plain_text, ids).run();
  if (!status.ok()) {
    ids.clear();
    return status;
  }
  if (add_special_tokens) {
    const auto& suffix = core_->post_processor.suffix();
    ids.insert(ids.end(), suffix.begin(), suffix.end());
  }
  return status;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special_tokens) const {
  DecodeState state;
  for (const std::int32_t id : ids) core_->decoder.feed(state, id, skip_special_tokens);
  core_->decoder.finish(state);
  return std::move(state.out);
}

std::int32_t Tokenizer::vocab_size() const {
  return static_cast<std::int32_t>(core_->tokens.size());
}

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = core_->added_ids.find(token); it != core_->added_ids.end()) return it->second;
  if (const auto it = core_->model.vocab().find(token); it != core_->model.vocab().end()) return it->second;
  return std::nullopt;
}

std::optional<std::string_view> Tokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || id >= vocab_size() || !core_->tokens[static_cast<std::size_t>(id)]) return std::nullopt;
  return *core_->tokens[static_cast<std::size_t>(id)];
}

bool Tokenizer::is_special(std::int32_t id) const {
  return id >= 0 && id < vocab_size() && core_->special[static_cast<std::size_t>(id)];
}

std::optional<std::int32_t> Tokenizer::bos_id() const {
  return core_->bos_id;
}
std::optional<std::int32_t> Tokenizer::eos_id() const {
  return core_->eos_id;
}
std::optional<std::int32_t> Tokenizer::pad_id() const {
  return core_->pad_id;
}

struct IncrementalDecoder::State : DecodeState {};

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : core_(tokenizer.core_), skip_special_tokens_(skip_special_tokens), state_(std::make_unique<State>()) {}
IncrementalDecoder::~IncrementalDecoder() = default;
IncrementalDecoder::IncrementalDecoder(IncrementalDecoder&&) noexcept = default;
IncrementalDecoder& IncrementalDecoder::operator=(IncrementalDecoder&&) noexcept = default;

std::string_view IncrementalDecoder::feed(std::int32_t id) {
  state_->out.clear();
  core_->decoder.feed(*state_, id, skip_special_tokens_);
  return state_->out;
}

std::string_view IncrementalDecoder::finish() {
  state_->out.clear();
  core_->decoder.finish(*state_);
  DecodeState& state = *state_;
  std::string out = std::move(state.out);
  state = DecodeState{};
  state.out = std::move(out);
  return state.out;
}

}  // namespace capserve::runtime
