#include "server/sequence_output.h"

#include <algorithm>

namespace capserve::server {

std::optional<SequenceOutput> SequenceOutputReader::next() {
  if (sequence_ >= result_.sequences.size()) return std::nullopt;
  const SequenceResult& s = result_.sequences[sequence_++];
  SequenceOutput out;
  out.id = s.id;
  out.result = &s;
  const auto kept = static_cast<std::size_t>(std::max(0, s.tokens));
  out.tokens = std::span(result_.tokens).subspan(token_, std::min(kept, result_.tokens.size() - token_));
  token_ += out.tokens.size();
  const std::size_t first_record = record_, first_top = top_;
  for (; record_ < result_.logprobs.size() && result_.logprobs[record_].id == s.id; ++record_) {
    const auto count = static_cast<std::size_t>(std::max(0, result_.logprobs[record_].top_count));
    if (count > result_.top_logprobs.size() - top_) break;  // malformed: no more entries from this rank
    top_ += count;
  }
  out.records = std::span(result_.logprobs).subspan(first_record, record_ - first_record);
  out.top = std::span(result_.top_logprobs).subspan(first_top, top_ - first_top);
  return out;
}

}  // namespace capserve::server
