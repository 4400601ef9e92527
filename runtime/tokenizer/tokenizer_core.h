#pragma once
// The loaded parts of a Tokenizer, shared (immutable) by its copies and IncrementalDecoders, plus the pool of
// per-thread encoding buffers.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/tokenizer/added_vocabulary.h"
#include "runtime/tokenizer/bpe_model.h"
#include "runtime/tokenizer/decoder.h"
#include "runtime/tokenizer/normalizer.h"
#include "runtime/tokenizer/post_processor.h"
#include "runtime/tokenizer/pre_tokenizer.h"
#include "runtime/tokenizer/string_map.h"

namespace capserve::runtime {

// Everything one encode() call works in; reused so that steady-state encoding allocates only for new words.
struct EncodeWorkspace {
  NormalizerScratch normalizer;
  std::string normalized;
  PreTokenizerScratch pre_tokenizer;
  BpeScratch bpe;
};

// Hands each concurrent encode() its own workspace, most recently returned first (warmest cache). Only as
// many idle workspaces are kept as the machine has cores: a burst of concurrent callers (a server's handler
// threads) would otherwise leave one word cache of up to a few MiB per caller behind for good.
class WorkspacePool {
 public:
  class Lease {
   public:
    Lease(const WorkspacePool& pool, std::unique_ptr<EncodeWorkspace> workspace)
        : pool_(pool), workspace_(std::move(workspace)) {}
    ~Lease() { pool_.give_back(std::move(workspace_)); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    EncodeWorkspace& operator*() const { return *workspace_; }

   private:
    const WorkspacePool& pool_;
    std::unique_ptr<EncodeWorkspace> workspace_;
  };

  [[nodiscard]] Lease acquire() const {
    std::unique_ptr<EncodeWorkspace> workspace;
    {
      const std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        workspace = std::move(free_.back());
        free_.pop_back();
      }
    }
    return {*this, workspace ? std::move(workspace) : std::make_unique<EncodeWorkspace>()};
  }

 private:
  void give_back(std::unique_ptr<EncodeWorkspace> workspace) const {
    const std::lock_guard lock(mutex_);
    if (free_.size() < kept_) free_.push_back(std::move(workspace));
  }

  const std::size_t kept_ = std::max(1U, std::thread::hardware_concurrency());

  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<EncodeWorkspace>> free_;
};

struct TokenizerCore {
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  BpeModel model;
  PostProcessor post_processor;
  Decoder decoder;
  AddedTokenMatcher raw_added_tokens;              // added tokens with normalized=false, matched on the input
  AddedTokenMatcher normalized_added_tokens;       // normalized=true, matched on normalized text
  StringMap<std::int32_t> added_ids;               // added token content -> id
  std::vector<std::optional<std::string>> tokens;  // id -> token
  std::vector<bool> special;                       // id -> special added token
  std::optional<std::int32_t> bos_id;
  std::optional<std::int32_t> eos_id;
  std::optional<std::int32_t> pad_id;
  WorkspacePool workspaces;
};

// Reads `dir`/tokenizer.json and, when present, `dir`/tokenizer_config.json.
std::shared_ptr<const TokenizerCore> load_tokenizer_core(const std::filesystem::path& dir);

}  // namespace capserve::runtime
