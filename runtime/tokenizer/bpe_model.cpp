#include "runtime/tokenizer/bpe_model.h"

#include <algorithm>
#include <limits>

#include "runtime/tokenizer/byte_level.h"
#include "runtime/tokenizer/utf8.h"

namespace capserve::runtime {
namespace {

// HF caches words shorter than 256 bytes; the cache is emptied when it reaches this many words.
constexpr std::size_t kMaxCachedWordLength = 256;
constexpr std::size_t kCacheCapacity = 1 << 16;

// Orders the merge queue as HF's Merge does: the lowest rank first, then the leftmost position.
bool later_merge(const BpeScratch::QueuedMerge& a, const BpeScratch::QueuedMerge& b) {
  return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
}

void add_symbol(std::vector<BpeScratch::Symbol>& symbols, std::int32_t id, std::uint32_t length) {
  const auto n = static_cast<std::int32_t>(symbols.size());
  if (n > 0) symbols.back().next = n;
  symbols.push_back({id, n - 1, -1, length});
}

std::string byte_token(unsigned byte) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  return std::string("<0x") + kHex[byte >> 4] + kHex[byte & 15] + ">";
}

}  // namespace

BpeModel BpeModel::from_json(const JsonAt& spec, bool byte_level) {
  const std::string type = spec.string_or("type", "");
  if (type != "BPE") spec.fail("unsupported model type '" + type + "' (only BPE is supported)");
  if (const auto dropout = spec.find("dropout")) {
    if (!dropout->json().is_number() || dropout->json().get<double>() != 0.0)
      dropout->fail("BPE dropout is not supported (encoding would be random)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!spec.string_or(key, "").empty()) spec.at(key).fail("a non-empty value is not supported");
  }
  BpeModel m;
  m.byte_level_ = byte_level;
  m.byte_fallback_ = spec.boolean_or("byte_fallback", false);
  m.fuse_unk_ = spec.boolean_or("fuse_unk", false);
  m.ignore_merges_ = spec.boolean_or("ignore_merges", false);
  m.load_vocab(spec.at("vocab"));
  if (const auto unk = spec.find("unk_token")) {
    const auto it = m.vocab_.find(unk->string());
    if (it == m.vocab_.end()) unk->fail("unk_token '" + unk->string() + "' is not in the vocabulary");
    m.unk_id_ = it->second;
  }
  m.load_merges(spec.at("merges"));
  m.prepare_units();
  return m;
}

void BpeModel::load_vocab(const JsonAt& vocab) {
  vocab.require_object();
  vocab_.reserve(vocab.json().size());
  std::vector<std::int32_t> ids;
  ids.reserve(vocab.json().size());
  for (auto it = vocab.json().begin(); it != vocab.json().end(); ++it) {
    const nlohmann::json& value = it.value();
    if (!value.is_number_integer() || value.get<std::int64_t>() < 0 ||
        value.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max()) {
      vocab.member(it.key(), value).fail("must be a token id (a non-negative 32-bit integer)");
    }
    const auto id = value.get<std::int64_t>();
    vocab_.emplace(it.key(), static_cast<std::int32_t>(id));
    ids.push_back(static_cast<std::int32_t>(id));
  }
  std::sort(ids.begin(), ids.end());
  const auto dup = std::adjacent_find(ids.begin(), ids.end());
  if (dup != ids.end()) vocab.fail("id " + std::to_string(*dup) + " is given to more than one token");
}

void BpeModel::load_merges(const JsonAt& merges) {
  merges.require_array();
  merges_.reserve(merges.json().size());
  const auto id_of = [&](const std::string& token, const JsonAt& at) {
    const auto it = vocab_.find(token);
    if (it == vocab_.end()) at.fail("merge token '" + token + "' is not in the vocabulary");
    return it->second;
  };
  std::uint32_t rank = 0;
  for (std::size_t i = 0; i < merges.json().size(); ++i) {
    const JsonAt merge = merges.at(i);
    std::string left;
    std::string right;
    if (merge.json().is_string()) {
      const std::string line = merge.string();
      if (line.starts_with("#version")) continue;  // merges.txt headers, skipped by HF
      const std::size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
        merge.fail("a merge string must be two tokens separated by one space");
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.json().is_array() && merge.json().size() == 2) {
      left = merge.at(0).string();
      right = merge.at(1).string();
    } else {
      merge.fail("a merge must be a string \"a b\" or a pair [\"a\", \"b\"]");
    }
    const std::int32_t left_id = id_of(left, merge);
    const std::int32_t right_id = id_of(right, merge);
    const std::int32_t merged = id_of(left + right, merge);
    merges_.insert(left_id, right_id, {rank++, merged});
  }
}

void BpeModel::prepare_units() {
  const auto lookup = [&](std::string_view token) {
    const auto it = vocab_.find(token);
    return it == vocab_.end() ? -1 : it->second;
  };
  for (unsigned b = 0; b < 256; ++b) {
    byte_fallback_ids_[b] = lookup(byte_token(b));
    if (byte_level_) {
      unit_ids_[b] = lookup(byte_level::byte_chars()[b]);
    } else {
      unit_ids_[b] = b < 0x80 ? lookup(std::string(1, static_cast<char>(b))) : -1;
    }
  }
  if (byte_level_ && ignore_merges_) {
    for (const auto& [token, id] : vocab_) {
      if (auto bytes = byte_level::to_bytes(token)) byte_vocab_.emplace(std::move(*bytes), id);
    }
  }
}

void BpeModel::initial_symbols(std::string_view word, BpeScratch& scratch) const {
  auto& symbols = scratch.symbols_;
  symbols.clear();
  std::int32_t pending_unk = -1;
  std::uint32_t pending_unk_length = 0;
  const auto add_unit = [&](std::string_view unit, std::int32_t id) {
    const auto length = static_cast<std::uint32_t>(unit.size());
    if (id >= 0) {
      if (pending_unk >= 0) add_symbol(symbols, pending_unk, pending_unk_length);
      pending_unk = -1;
      add_symbol(symbols, id, length);
      return;
    }
    if (byte_fallback_ && std::all_of(unit.begin(), unit.end(), [&](char c) {
          return byte_fallback_ids_[static_cast<unsigned char>(c)] >= 0;
        })) {
      // As in HF, a pending unk is not flushed first: it lands after these byte tokens.
      for (const char c : unit) add_symbol(symbols, byte_fallback_ids_[static_cast<unsigned char>(c)], 1);
      return;
    }
    if (unk_id_ < 0) return;  // HF drops the unit when there is no unk token
    if (pending_unk >= 0 && fuse_unk_) {
      pending_unk_length += length;
      return;
    }
    if (pending_unk >= 0) add_symbol(symbols, pending_unk, pending_unk_length);
    pending_unk = unk_id_;
    pending_unk_length = length;
  };
  if (byte_level_) {
    for (const char c : word) {
      const auto b = static_cast<unsigned char>(c);
      add_unit(byte_level::byte_chars()[b], unit_ids_[b]);
    }
  } else {
    for (std::size_t pos = 0; pos < word.size();) {
      const auto lead = static_cast<unsigned char>(word[pos]);
      const std::size_t length = std::min(utf8::sequence_length(lead), word.size() - pos);
      const std::string_view unit = word.substr(pos, length);
      std::int32_t id = -1;
      if (length == 1) {
        id = unit_ids_[lead];
      } else if (const auto it = vocab_.find(unit); it != vocab_.end()) {
        id = it->second;
      }
      add_unit(unit, id);
      pos += length;
    }
  }
  if (pending_unk >= 0) add_symbol(symbols, pending_unk, pending_unk_length);
}

void BpeModel::merge_all(BpeScratch& scratch) const {
  auto& symbols = scratch.symbols_;
  auto& queue = scratch.queue_;
  queue.clear();
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeRule* rule = merges_.find(symbols[i].id, symbols[i + 1].id))
      queue.push_back({rule->rank, static_cast<std::uint32_t>(i), rule->merged});
  }
  std::make_heap(queue.begin(), queue.end(), later_merge);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), later_merge);
    const BpeScratch::QueuedMerge top = queue.back();
    queue.pop_back();
    BpeScratch::Symbol& left = symbols[top.position];
    if (left.length == 0 || left.next < 0) continue;
    const BpeScratch::Symbol right = symbols[static_cast<std::size_t>(left.next)];
    // Skip entries made stale by earlier merges: the pair there must still merge into the same token.
    const MergeRule* current = merges_.find(left.id, right.id);
    if (current == nullptr || current->merged != top.merged) continue;
    symbols[static_cast<std::size_t>(left.next)].length = 0;
    left.id = top.merged;
    left.length += right.length;
    left.next = right.next;
    if (right.next >= 0)
      symbols[static_cast<std::size_t>(right.next)].prev = static_cast<std::int32_t>(top.position);
    if (left.prev >= 0) {
      const BpeScratch::Symbol& before = symbols[static_cast<std::size_t>(left.prev)];
      if (const MergeRule* rule = merges_.find(before.id, left.id)) {
        queue.push_back({rule->rank, static_cast<std::uint32_t>(left.prev), rule->merged});
        std::push_heap(queue.begin(), queue.end(), later_merge);
      }
    }
    if (left.next >= 0) {
      const BpeScratch::Symbol& after = symbols[static_cast<std::size_t>(left.next)];
      if (const MergeRule* rule = merges_.find(left.id, after.id)) {
        queue.push_back({rule->rank, top.position, rule->merged});
        std::push_heap(queue.begin(), queue.end(), later_merge);
      }
    }
  }
}

void BpeModel::encode_word(std::string_view word, BpeScratch& scratch, std::vector<std::int32_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const auto& whole = byte_level_ ? byte_vocab_ : vocab_;
    if (const auto it = whole.find(word); it != whole.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  if (const auto hit = scratch.cache_.find(word); hit != scratch.cache_.end()) {
    const auto begin = scratch.cached_ids_.begin() + hit->second.offset;
    ids.insert(ids.end(), begin, begin + hit->second.count);
    return;
  }
  initial_symbols(word, scratch);
  if (scratch.symbols_.size() > 1) merge_all(scratch);
  const std::size_t first = ids.size();
  for (const BpeScratch::Symbol& s : scratch.symbols_) {
    if (s.length != 0) ids.push_back(s.id);
  }
  if (word.size() < kMaxCachedWordLength) {
    if (scratch.cache_.size() >= kCacheCapacity) {
      scratch.cache_.clear();
      scratch.cached_ids_.clear();
    }
    const auto offset = static_cast<std::uint32_t>(scratch.cached_ids_.size());
    scratch.cached_ids_.insert(scratch.cached_ids_.end(), ids.begin() + static_cast<std::ptrdiff_t>(first),
                               ids.end());
    scratch.cache_.emplace(std::string(word),
                           BpeScratch::CachedWord{offset, static_cast<std::uint32_t>(ids.size() - first)});
  }
}

}  // namespace capserve::runtime
