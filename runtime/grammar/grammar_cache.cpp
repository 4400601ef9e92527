#include "runtime/grammar/grammar_cache.h"

#include <nlohmann/json.hpp>
#include <utility>

#include "runtime/grammar/structured_output.h"

namespace capserve::runtime::grammar {

GrammarCache::GrammarCache(std::shared_ptr<const TokenVocabulary> vocabulary, std::size_t capacity)
    : vocabulary_(std::move(vocabulary)), capacity_(capacity) {}

StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCache::get(std::string_view spec) {
  const std::string key(spec);
  {
    const std::scoped_lock lock(mutex_);
    if (const auto it = entries_.find(key); it != entries_.end()) {
      recency_.splice(recency_.begin(), recency_, it->second.recency);
      return it->second.grammar;
    }
  }
  const nlohmann::ordered_json parsed = nlohmann::ordered_json::parse(key, nullptr, false);
  if (parsed.is_discarded()) return Status::invalid_argument("a constraint is a JSON object");
  StatusOr<OutputConstraint> constraint = parse_constraint(parsed);
  if (!constraint.ok()) return std::move(constraint).take_status();
  StatusOr<std::shared_ptr<const CompiledGrammar>> compiled = compile(*constraint, vocabulary_);
  if (!compiled.ok() || capacity_ == 0) return compiled;
  const std::scoped_lock lock(mutex_);
  // Another thread may have compiled the same constraint meanwhile: keep the first.
  if (const auto it = entries_.find(key); it != entries_.end()) return it->second.grammar;
  recency_.push_front(key);
  entries_.emplace(key, Entry{*compiled, recency_.begin()});
  if (entries_.size() > capacity_) {
    entries_.erase(recency_.back());
    recency_.pop_back();
  }
  return compiled;
}

std::size_t GrammarCache::size() const {
  const std::scoped_lock lock(mutex_);
  return entries_.size();
}

}  // namespace capserve::runtime::grammar
