// Builds a TokenizerCore from tokenizer.json and tokenizer_config.json, checking every part.
#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include <fstream>

#include "runtime/json_file.h"
#include "runtime/load_error.h"
#include "runtime/tokenizer/tokenizer_core.h"

namespace capserve::runtime {
namespace {

// HF AddedToken defaults for fields a file leaves out.
AddedToken read_added_token(const JsonAt& spec) {
  AddedToken t;
  t.content = spec.at("content").string();
  const std::int64_t id = spec.at("id").integer();
  if (id < 0 || id > std::numeric_limits<std::int32_t>::max()) spec.at("id").fail("id out of range");
  t.id = static_cast<std::int32_t>(id);
  t.special = spec.boolean_or("special", false);
  t.single_word = spec.boolean_or("single_word", false);
  t.lstrip = spec.boolean_or("lstrip", false);
  t.rstrip = spec.boolean_or("rstrip", false);
  t.normalized = spec.boolean_or("normalized", true);
  return t;
}

// Registers the added tokens the way HF's AddedVocabulary::add_tokens does (ids come from the vocabulary or
// are handed out in order after it), and refuses a file whose written ids disagree with what HF would use.
// Also builds the id -> token table.
void add_tokens(TokenizerCore& core, const std::optional<JsonAt>& list) {
  std::map<std::int32_t, AddedToken> by_id;  // HF's added_tokens_map_r
  std::set<std::string, std::less<>> special_contents;
  auto next_id = static_cast<std::int32_t>(core.model.vocab().size());
  if (list) list->require_array();
  for (std::size_t i = 0; list && i < list->json().size(); ++i) {
    const JsonAt spec = list->at(i);
    AddedToken token = read_added_token(spec);
    if (token.content.empty()) continue;
    std::int32_t id = 0;
    if (const auto it = core.added_ids.find(token.content); it != core.added_ids.end()) {
      id = it->second;
    } else if (const auto v = core.model.vocab().find(token.content); v != core.model.vocab().end()) {
      id = v->second;
    } else {
      id = next_id++;
    }
    if (id != token.id) {
      spec.at("id").fail("added token '" + token.content + "' is written with id " +
                         std::to_string(token.id) + " but HF tokenizers gives it id " + std::to_string(id));
    }
    core.added_ids[token.content] = id;
    if (token.special) special_contents.insert(token.content);
    by_id[id] = std::move(token);
  }
  std::vector<AddedToken> raw;
  std::vector<AddedToken> normalized;
  std::vector<std::string> raw_patterns;
  std::vector<std::string> normalized_patterns;
  NormalizerScratch scratch;
  for (auto& [id, token] : by_id) {
    if (token.normalized) {
      std::string pattern;
      core.normalizer.normalize(token.content, pattern, scratch);
      normalized_patterns.push_back(std::move(pattern));
      normalized.push_back(token);
    } else {
      raw_patterns.push_back(token.content);
      raw.push_back(token);
    }
  }
  core.raw_added_tokens = AddedTokenMatcher(raw, raw_patterns);
  core.normalized_added_tokens = AddedTokenMatcher(normalized, normalized_patterns);

  std::int32_t size = 0;
  for (const auto& [token, id] : core.model.vocab()) size = std::max(size, id + 1);
  for (const auto& [id, token] : by_id) size = std::max(size, id + 1);
  core.tokens.assign(static_cast<std::size_t>(size), std::nullopt);
  for (const auto& [token, id] : core.model.vocab()) core.tokens[static_cast<std::size_t>(id)] = token;
  for (const auto& [id, token] : by_id) core.tokens[static_cast<std::size_t>(id)] = token.content;
  core.special.assign(core.tokens.size(), false);
  for (std::size_t id = 0; id < core.tokens.size(); ++id) {
    core.special[id] = core.tokens[id] && special_contents.contains(*core.tokens[id]);
  }
}

// bos_token etc. are a string, an {"content": ...} object (transformers' AddedToken), or null.
std::optional<std::int32_t> special_token_id(const TokenizerCore& core, const JsonAt& config,
                                             const char* key) {
  const auto value = config.find(key);
  if (!value) return std::nullopt;
  const std::string content = value->json().is_object() ? value->at("content").string() : value->string();
  if (const auto it = core.added_ids.find(content); it != core.added_ids.end()) return it->second;
  if (const auto it = core.model.vocab().find(content); it != core.model.vocab().end()) return it->second;
  value->fail("token '" + content + "' is not in the tokenizer's vocabulary");
}

}  // namespace

std::shared_ptr<const TokenizerCore> load_tokenizer_core(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "tokenizer.json";
  const std::string file = path.string();
  const nlohmann::json json = read_json_file(path);
  const JsonAt root(json, file);
  root.require_object();
  for (const char* unsupported : {"truncation", "padding"}) {
    if (root.find(unsupported)) root.at(unsupported).fail("is not supported (must be null)");
  }
  auto core = std::make_shared<TokenizerCore>();
  core->normalizer = Normalizer::from_json(root.find("normalizer"));
  core->pre_tokenizer = PreTokenizer::from_json(root.find("pre_tokenizer"));
  if (core->normalizer.prepends() && core->pre_tokenizer.has_metaspace_first()) {
    root.at("normalizer")
        .fail("a Prepend normalizer with a Metaspace prepend_scheme 'first' is not supported");
  }
  core->model = BpeModel::from_json(root.at("model"), core->pre_tokenizer.byte_level());
  add_tokens(*core, root.find("added_tokens"));
  core->post_processor = PostProcessor::from_json(root.find("post_processor"));
  for (const std::vector<std::int32_t>* ids :
       {&core->post_processor.prefix(), &core->post_processor.suffix()}) {
    for (const std::int32_t id : *ids) {
      if (static_cast<std::size_t>(id) >= core->tokens.size() || !core->tokens[static_cast<std::size_t>(id)])
        root.at("post_processor").fail("special token id " + std::to_string(id) + " has no token");
    }
  }
  core->decoder = Decoder::from_json(root.find("decoder"), core->tokens, core->special);

  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(config_path)) {
    const std::string config_file = config_path.string();
    const nlohmann::json config_json = read_json_file(config_path);
    const JsonAt config(config_json, config_file);
    config.require_object();
    core->bos_id = special_token_id(*core, config, "bos_token");
    core->eos_id = special_token_id(*core, config, "eos_token");
    core->pad_id = special_token_id(*core, config, "pad_token");
  }
  return core;
}

}  // namespace capserve::runtime
