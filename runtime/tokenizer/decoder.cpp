#include "runtime/tokenizer/decoder.h"

#include "runtime/tokenizer/byte_level.h"
#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime {
namespace {

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// HF's ByteFallback test: six bytes "<0x..>" whose middle parses with u8::from_str_radix(_, 16), which also
// takes a leading '+'.
std::int16_t byte_of_token(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token.back() != '>') return -1;
  const int hi = token[3] == '+' ? 0 : hex_digit(token[3]);
  const int lo = hex_digit(token[4]);
  if (hi < 0 || lo < 0) return -1;
  return static_cast<std::int16_t>(hi * 16 + lo);
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  std::size_t pos = 0;
  for (std::size_t hit; (hit = text.find(from, pos)) != std::string_view::npos; pos = hit + from.size()) {
    out.append(text.substr(pos, hit - pos));
    out.append(to);
  }
  out.append(text.substr(pos));
  return out;
}

// Strip applied to one token: up to `start` leading and `stop` trailing `content` characters removed.
std::string strip_token(std::string_view token, std::string_view content, std::int64_t start,
                        std::int64_t stop) {
  std::size_t begin = 0;
  for (std::int64_t i = 0; i < start && token.substr(begin).starts_with(content); ++i)
    begin += content.size();
  std::size_t end = token.size();
  for (std::int64_t i = 0;
       i < stop && end >= begin + content.size() && token.substr(0, end).ends_with(content); ++i) {
    end -= content.size();
  }
  return std::string(token.substr(begin, end - begin));
}

}  // namespace

Decoder Decoder::from_json(const std::optional<JsonAt>& spec,
                           const std::vector<std::optional<std::string>>& tokens,
                           const std::vector<bool>& special) {
  Decoder d;
  if (spec) {
    std::vector<JsonAt> chain;
    d.add_step(*spec, chain);
    d.compile(chain);
  }
  d.special_ = special;
  d.present_.resize(tokens.size());
  d.rest_.resize(tokens.size());
  if (d.position_dependent_) d.first_.resize(tokens.size());
  for (std::size_t id = 0; id < tokens.size(); ++id) {
    if (!tokens[id]) continue;
    d.present_[id] = true;
    d.rest_[id] = d.make_piece(*tokens[id], false);
    if (d.position_dependent_) d.first_[id] = d.make_piece(*tokens[id], true);
  }
  return d;
}

void Decoder::add_step(const JsonAt& spec, std::vector<JsonAt>& chain) {
  if (spec.type() == "Sequence") {
    const JsonAt list = spec.at("decoders");
    list.require_array();
    for (std::size_t i = 0; i < list.json().size(); ++i) add_step(list.at(i), chain);
  } else {
    chain.push_back(spec);
  }
}

void Decoder::compile(const std::vector<JsonAt>& chain) {
  mode_ = Mode::pieces;
  bool fused = false;
  bool after_token_ops = false;  // past the per-token steps (ByteFallback, Fuse or Strip seen)
  for (const JsonAt& step : chain) {
    const std::string type = step.type();
    if (type == "ByteLevel") {
      if (chain.size() != 1) step.fail("a ByteLevel decoder is only supported on its own");
      mode_ = Mode::byte_level;
    } else if (type == "Replace" || type == "Metaspace") {
      if (after_token_ops) step.fail(type + " after ByteFallback, Fuse or Strip is not supported");
      TokenOp op{};
      if (type == "Replace") {
        const auto literal = step.at("pattern").find("String");
        if (!literal) step.at("pattern").fail("only {\"String\": ...} patterns are supported");
        if (literal->string().empty()) literal->fail("must not be empty");
        op = {TokenOp::Kind::replace, literal->string(), step.at("content").string(), false};
      } else {
        const std::string scheme = step.string_or("prepend_scheme", "always");
        if (scheme != "always" && scheme != "first" && scheme != "never")
          step.at("prepend_scheme").fail("unknown prepend_scheme '" + scheme + "'");
        if (!step.boolean_or("add_prefix_space", true) && scheme != "never")
          step.at("add_prefix_space").fail("add_prefix_space does not match declared prepend_scheme");
        op = {TokenOp::Kind::metaspace, step.at("replacement").character(), " ", scheme != "never"};
        position_dependent_ = position_dependent_ || op.strip_first;
      }
      ops_.push_back(std::move(op));
    } else if (type == "ByteFallback") {
      if (after_token_ops) step.fail("ByteFallback after Fuse or Strip is not supported");
      byte_fallback_ = true;
      after_token_ops = true;
    } else if (type == "Fuse") {
      fused = true;
      after_token_ops = true;
    } else if (type == "Strip") {
      if (strip_) step.fail("more than one Strip decoder is not supported");
      const std::int64_t start = step.at("start").integer();
      const std::int64_t stop = step.at("stop").integer();
      if (start < 0 || stop < 0) step.fail("start and stop must not be negative");
      strip_ = Strip{step.at("content").character(), start, stop, fused};
      after_token_ops = true;
    } else {
      step.at("type").fail("unsupported decoder type '" + type + "'");
    }
  }
}

Decoder::Piece Decoder::make_piece(const std::string& token, bool first) const {
  if (mode_ == Mode::byte_level) {
    auto bytes = byte_level::to_bytes(token);
    return {bytes ? std::move(*bytes) : token, -1};
  }
  std::string text = token;
  for (const TokenOp& op : ops_) {
    if (op.kind == TokenOp::Kind::replace) {
      text = replace_all(text, op.from, op.to);
    } else {
      text = replace_all(text, op.from, first && op.strip_first ? "" : op.to);
    }
  }
  const std::int16_t byte = byte_fallback_ ? byte_of_token(text) : std::int16_t{-1};
  return {std::move(text), byte};
}

void Decoder::feed(DecodeState& state, std::int32_t id, bool skip_special_tokens) const {
  if (id < 0 || static_cast<std::size_t>(id) >= present_.size() || !present_[static_cast<std::size_t>(id)])
    return;
  const auto index = static_cast<std::size_t>(id);
  if (skip_special_tokens && special_[index]) return;
  const bool first = state.tokens++ == 0;
  const Piece& piece = first && position_dependent_ ? first_[index] : rest_[index];
  switch (mode_) {
    case Mode::join_with_spaces:
      if (!first) state.out.push_back(' ');
      state.out.append(piece.text);
      return;
    case Mode::byte_level: {
      std::string& bytes = state.pending_bytes;
      bytes.append(piece.text);
      const std::size_t ready = bytes.size() - utf8::incomplete_suffix_length(bytes);
      utf8::append_lossy(state.out, std::string_view(bytes).substr(0, ready));
      bytes.erase(0, ready);
      return;
    }
    case Mode::pieces:
      if (piece.byte >= 0) {
        state.pending_bytes.push_back(static_cast<char>(piece.byte));
        return;
      }
      flush_byte_run(state);
      emit(state, piece.text);
      return;
  }
}

void Decoder::flush_byte_run(DecodeState& state) const {
  if (state.pending_bytes.empty()) return;
  if (utf8::is_valid(state.pending_bytes)) {
    emit(state, state.pending_bytes);
  } else {
    // HF gives one U+FFFD token per byte of an invalid run.
    for (std::size_t i = 0; i < state.pending_bytes.size(); ++i) emit(state, utf8::kReplacementCharacter);
  }
  state.pending_bytes.clear();
}

void Decoder::emit(DecodeState& state, std::string_view text) const {
  if (!strip_) {
    state.out.append(text);
    return;
  }
  const Strip& s = *strip_;
  if (!s.fused) {
    state.out.append(strip_token(text, s.content, s.start, s.stop));
    return;
  }
  if (state.strip_left < 0) state.strip_left = s.start;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t length = utf8::sequence_length(static_cast<unsigned char>(text[pos]));
    const std::string_view ch = text.substr(pos, length);
    pos += length;
    const bool is_content = ch == s.content;
    if (state.strip_left > 0 && is_content) {
      --state.strip_left;
      continue;
    }
    state.strip_left = 0;
    if (s.stop > 0 && is_content) {
      state.held.append(ch);
      continue;
    }
    state.out.append(state.held);
    state.held.clear();
    state.out.append(ch);
  }
}

void Decoder::finish(DecodeState& state) const {
  if (mode_ == Mode::byte_level) {
    utf8::append_lossy(state.out, state.pending_bytes);
    state.pending_bytes.clear();
    return;
  }
  flush_byte_run(state);
  if (strip_ && strip_->fused && !state.held.empty()) {
    const std::size_t held_chars = state.held.size() / strip_->content.size();
    const auto dropped = std::min<std::size_t>(held_chars, static_cast<std::size_t>(strip_->stop));
    state.out.append(state.held, 0, (held_chars - dropped) * strip_->content.size());
    state.held.clear();
  }
}

}  // namespace capserve::runtime
