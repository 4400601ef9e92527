#pragma once
// Log-probabilities of one step's scored tokens, on the host (Engine::score): per logits row the scored
// token's, and the row's top_k most likely tokens with theirs, most likely first. The storage is the packed
// layout the backend wrote on its device (values f32 [rows, 1 + top_k], then ids int32 [rows, top_k]), so
// that one copy, one synchronisation, brings it all; it is reused from step to step.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace capserve::runtime {

class TokenLogprobs {
 public:
  [[nodiscard]] std::int64_t rows() const { return rows_; }
  [[nodiscard]] std::int64_t top_k() const { return top_k_; }
  // The scored token of `row`: NaN for a token outside the vocabulary.
  [[nodiscard]] float logprob(std::int64_t row) const { return value(row * (1 + top_k_)); }
  // The row's (j+1)-th most likely token and its log-probability, j < top_k.
  [[nodiscard]] std::int32_t top_id(std::int64_t row, std::int64_t j) const {
    return std::bit_cast<std::int32_t>(
        words_[static_cast<std::size_t>(rows_ * (1 + top_k_) + row * top_k_ + j)]);
  }
  [[nodiscard]] float top_logprob(std::int64_t row, std::int64_t j) const {
    return value(row * (1 + top_k_) + 1 + j);
  }

  // Sizes the storage for `rows` x `top_k` and returns it, for the backend's copy.
  std::span<std::byte> reset(std::int64_t rows, std::int64_t top_k) {
    rows_ = rows;
    top_k_ = top_k;
    words_.resize(static_cast<std::size_t>(rows * (1 + 2 * top_k)));
    return std::as_writable_bytes(std::span(words_));
  }

 private:
  [[nodiscard]] float value(std::int64_t word) const {
    return std::bit_cast<float>(words_[static_cast<std::size_t>(word)]);
  }

  std::int64_t rows_ = 0;
  std::int64_t top_k_ = 0;
  std::vector<std::uint32_t> words_;
};

}  // namespace capserve::runtime
