#pragma once
// A process's compiled grammars, by constraint: the server's intake compiles a request's constraint once (its
// errors are the request's 400) and the rank that samples the sequence finds it here, compiled. Recently used
// grammars stay, up to a count, so that requests repeating a schema (the common case: one application, one
// schema) never compile again. Thread-safe: intake threads and the step loop share it; a compile runs
// outside the lock, so one large schema never holds up another request's lookup.
#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "runtime/grammar/compiled_grammar.h"
#include "runtime/status.h"

namespace capserve::runtime::grammar {

class GrammarCache {
 public:
  GrammarCache(std::shared_ptr<const TokenVocabulary> vocabulary, std::size_t capacity);

  // The compiled grammar of a constraint spelled as parse_constraint reads it (JSON text); invalid_argument
  // naming what the engine refuses (the keyword, the construct, the size) when it cannot be compiled.
  StatusOr<std::shared_ptr<const CompiledGrammar>> get(std::string_view spec);

  [[nodiscard]] const TokenVocabulary& vocabulary() const { return *vocabulary_; }
  [[nodiscard]] std::size_t size() const;

 private:
  using Recency = std::list<std::string>;  // most recent first
  struct Entry {
    std::shared_ptr<const CompiledGrammar> grammar;
    Recency::iterator recency;
  };

  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, Entry> entries_;
  Recency recency_;
};

}  // namespace capserve::runtime::grammar
