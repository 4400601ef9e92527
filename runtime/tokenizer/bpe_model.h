#pragma once
// The tokenizer.json "model" of type BPE: vocabulary, merges in either encoding ("a b" strings or ["a", "b"]
// pairs), unk_token and fuse_unk, byte_fallback (<0xXX> tokens), ignore_merges. A word is merged exactly like
// HF's Word::merge_all (lowest rank first, leftmost among equals, stale queue entries skipped), and encoded
// words are cached per thread.
//
// In byte-level mode (a ByteLevel pre-tokenizer) words arrive as raw bytes and every byte is one initial
// symbol: the same symbols HF gets from the byte-to-character re-encoding, without doing it.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tokenizer/json_at.h"
#include "runtime/tokenizer/merge_table.h"
#include "runtime/tokenizer/string_map.h"

namespace capserve::runtime {

// Per-thread buffers and the word cache of one BpeModel.
class BpeScratch {
 public:
  struct Symbol {
    std::int32_t id;
    std::int32_t prev;
    std::int32_t next;
    std::uint32_t length;  // 0 once merged into its left neighbour
  };
  struct QueuedMerge {
    std::uint32_t rank;
    std::uint32_t position;
    std::int32_t merged;
  };

 private:
  friend class BpeModel;
  struct CachedWord {
    std::uint32_t offset;
    std::uint32_t count;
  };
  std::vector<Symbol> symbols_;
  std::vector<QueuedMerge> queue_;
  StringMap<CachedWord> cache_;
  std::vector<std::int32_t> cached_ids_;
};

class BpeModel {
 public:
  static BpeModel from_json(const JsonAt& spec, bool byte_level);

  // Appends the ids of `word` (UTF-8 text, or raw bytes in byte-level mode) to `ids`.
  void encode_word(std::string_view word, BpeScratch& scratch, std::vector<std::int32_t>& ids) const;

  // The vocabulary as written in tokenizer.json (byte-level tokens in their character spelling).
  [[nodiscard]] const StringMap<std::int32_t>& vocab() const { return vocab_; }

 private:
  void load_vocab(const JsonAt& vocab);
  void load_merges(const JsonAt& merges);
  void prepare_units();
  // Starts a word as HF's merge_word does: one symbol per unit (character, or byte in byte-level mode), with
  // byte_fallback and unk for units outside the vocabulary.
  void initial_symbols(std::string_view word, BpeScratch& scratch) const;
  void merge_all(BpeScratch& scratch) const;

  bool byte_level_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  std::int32_t unk_id_ = -1;
  StringMap<std::int32_t> vocab_;
  StringMap<std::int32_t> byte_vocab_;  // byte-level mode with ignore_merges: whole words by their raw bytes
  MergeTable merges_;
  std::array<std::int32_t, 256> unit_ids_{};           // id of each ASCII character, or of each byte
  std::array<std::int32_t, 256> byte_fallback_ids_{};  // id of <0xXX>, or -1
};

}  // namespace capserve::runtime
