// capserve-tokenize: encodes text to token ids, or with --decode turns ids back into text, one record per
// input line and one output line per record.
//   default   each line of stdin is one text (so a text cannot contain a newline); out: space-separated ids.
//             Decode: a line of space-separated ids in, its text out.
//   --jsonl   each line is one JSON value: a string to encode (any text: newlines, empty) giving a JSON array
//             of ids, or with --decode an array of ids giving a JSON string.
// A record that cannot be handled gets an error on stderr naming its line, an empty output line (`null` with
// --jsonl), and makes the exit status 1; the other records are still processed.
#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cli/flag_checks.h"
#include "runtime/cli/version.h"
#include "runtime/load_error.h"
#include "runtime/token_ids_text.h"
#include "runtime/tokenizer/tokenizer.h"

namespace {

using capserve::runtime::Tokenizer;

// Empty when every id has a token; otherwise why not, naming the first bad id and the vocabulary size.
std::string check_ids(const Tokenizer& tokenizer, std::span<const std::int32_t> ids) {
  for (const std::int32_t id : ids) {
    if (id < 0 || id >= tokenizer.vocab_size()) {
      return "token id " + std::to_string(id) + " is outside the vocabulary (" +
             std::to_string(tokenizer.vocab_size()) + " ids: 0.." +
             std::to_string(tokenizer.vocab_size() - 1) + ")";
    }
    if (!tokenizer.id_to_token(id)) {
      return "token id " + std::to_string(id) + " has no token in this vocabulary (" +
             std::to_string(tokenizer.vocab_size()) + " ids)";
    }
  }
  return {};
}

struct Options {
  bool decode = false;
  bool no_special_tokens = false;
};

// One record in, its output (without the newline) and an error message (empty on success).
struct Result {
  std::string out;
  std::string error;
};

Result encode_ids_text(const Tokenizer& tokenizer, std::string_view text, const Options& o,
                       std::vector<std::int32_t>& ids) {
  if (const auto status = tokenizer.encode(text, !o.no_special_tokens, ids); !status.ok())
    return {{}, status.message()};
  Result r;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) r.out.push_back(' ');
    r.out += std::to_string(ids[i]);
  }
  return r;
}

Result handle_line(const Tokenizer& tokenizer, const std::string& line, const Options& o,
                   std::vector<std::int32_t>& ids) {
  if (!o.decode) return encode_ids_text(tokenizer, line, o, ids);
  if (!capserve::runtime::parse_token_ids(line, ids)) return {{}, "not a list of token ids"};
  if (std::string why = check_ids(tokenizer, ids); !why.empty()) return {{}, std::move(why)};
  return {tokenizer.decode(ids, o.no_special_tokens), {}};
}

Result handle_json_line(const Tokenizer& tokenizer, const std::string& line, const Options& o,
                        std::vector<std::int32_t>& ids) {
  using nlohmann::json;
  Result failed{"null", {}};
  json value;
  try {
    value = json::parse(line);
  } catch (const json::parse_error& e) {
    failed.error = std::string("not valid JSON (") + e.what() + ")";
    return failed;
  }
  if (!o.decode) {
    if (!value.is_string()) {
      failed.error = "expected a JSON string to encode, got " + std::string(value.type_name());
      return failed;
    }
    if (const auto status = tokenizer.encode(value.get_ref<const std::string&>(), !o.no_special_tokens, ids);
        !status.ok()) {
      failed.error = status.message();
      return failed;
    }
    return {json(ids).dump(), {}};
  }
  if (!value.is_array()) {
    failed.error = "expected a JSON array of token ids, got " + std::string(value.type_name());
    return failed;
  }
  ids.clear();
  for (const json& v : value) {
    if (!v.is_number_integer() || v.get<std::int64_t>() < 0 ||
        v.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max()) {
      failed.error = "token ids must be non-negative integers, got " + v.dump();
      return failed;
    }
    ids.push_back(static_cast<std::int32_t>(v.get<std::int64_t>()));
  }
  if (std::string why = check_ids(tokenizer, ids); !why.empty()) {
    failed.error = std::move(why);
    return failed;
  }
  // decode() already turns bytes that are not UTF-8 into U+FFFD (as HF does); `replace` only guards dump().
  return {
      json(tokenizer.decode(ids, o.no_special_tokens)).dump(-1, ' ', false, json::error_handler_t::replace),
      {}};
}

}  // namespace

int main(int argc, char** argv) {
  capserve::runtime::log_to_stderr();
  using namespace capserve;
  CLI::App app{"Encode text to token ids (or decode ids) with a Hugging Face tokenizer"};
  capserve::runtime::add_common_flags(app, "capserve-tokenize");
  std::string dir;
  Options options;
  bool jsonl = false;
  app.add_option("--tokenizer", dir, "directory with tokenizer.json (and tokenizer_config.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_flag("--decode", options.decode, "read token ids and print their text");
  app.add_flag("--jsonl", jsonl,
               "exact strings: each input line a JSON string (encode) or JSON array of ids (decode); each "
               "output line a JSON array of ids or a JSON string");
  app.add_flag(
      "--no-special-tokens", options.no_special_tokens,
      "encode: do not add the post-processor's special tokens (BOS...); decode: skip special tokens");
  if (const auto bad =
          capserve::runtime::flag_with_empty_value({argv + 1, static_cast<std::size_t>(argc - 1)})) {
    std::cerr << "capserve-tokenize: " << *bad << " has an empty value\n";
    return 2;
  }
  CLI11_PARSE(app, argc, argv);

  std::optional<Tokenizer> tokenizer;
  try {
    tokenizer = Tokenizer::load(dir);
  } catch (const runtime::LoadError& e) {
    std::cerr << "capserve-tokenize: " << e.what() << "\n";
    return 1;
  }
  std::ios::sync_with_stdio(false);
  int exit_code = 0;
  std::string line;
  std::vector<std::int32_t> ids;
  for (std::size_t number = 1; std::getline(std::cin, line); ++number) {
    const Result r = jsonl ? handle_json_line(*tokenizer, line, options, ids)
                           : handle_line(*tokenizer, line, options, ids);
    if (!r.error.empty()) {
      std::cerr << "capserve-tokenize: line " << number << ": " << r.error << "\n";
      exit_code = 1;
    }
    std::cout << r.out << '\n';
  }
  return exit_code;
}
