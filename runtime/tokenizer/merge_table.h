#pragma once
// BPE merge lookup: (left id, right id) -> (rank, merged id) in an open-addressing table, the innermost
// lookup of the merge loop.
#include <cstdint>
#include <vector>

namespace capserve::runtime {

struct MergeRule {
  std::uint32_t rank = 0;
  std::int32_t merged = -1;
};

class MergeTable {
 public:
  void reserve(std::size_t count) {
    std::size_t capacity = 16;
    while (capacity < count * 2) capacity *= 2;
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
  }

  // Later insertions of the same pair win, as when HF collects its merges into a hash map.
  void insert(std::int32_t left, std::int32_t right, MergeRule rule) {
    const std::uint64_t key = pack(left, right);
    for (std::size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty || slots_[i].key == key) {
        slots_[i] = {key, rule};
        return;
      }
    }
  }

  [[nodiscard]] const MergeRule* find(std::int32_t left, std::int32_t right) const {
    const std::uint64_t key = pack(left, right);
    for (std::size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].rule;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  struct Slot {
    std::uint64_t key = kEmpty;
    MergeRule rule;
  };
  static std::uint64_t pack(std::int32_t left, std::int32_t right) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) |
           static_cast<std::uint32_t>(right);
  }
  static std::size_t hash(std::uint64_t key) {
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    return static_cast<std::size_t>(key);
  }

  std::vector<Slot> slots_{16};
  std::size_t mask_ = 15;
};

}  // namespace capserve::runtime
