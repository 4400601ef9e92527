// capserve-tokenize: encodes each line of stdin to space-separated ids, or with --decode turns each line of
// ids back into text. One output line per input line; a line that cannot be handled gets an error on stderr,
// an empty output line, and makes the exit status 1.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "runtime/load_error.h"
#include "runtime/token_ids_text.h"
#include "runtime/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  using namespace capserve;
  CLI::App app{"Encode lines of text to token ids (or decode ids) with a Hugging Face tokenizer"};
  std::string dir;
  bool decode = false;
  bool no_special_tokens = false;
  app.add_option("--tokenizer", dir, "directory with tokenizer.json (and tokenizer_config.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_flag("--decode", decode, "read lines of space-separated ids and print their text");
  app.add_flag(
      "--no-special-tokens", no_special_tokens,
      "encode: do not add the post-processor's special tokens (BOS...); decode: skip special tokens");
  CLI11_PARSE(app, argc, argv);

  std::optional<runtime::Tokenizer> tokenizer;
  try {
    tokenizer = runtime::Tokenizer::load(dir);
  } catch (const runtime::LoadError& e) {
    std::cerr << "capserve-tokenize: " << e.what() << "\n";
    return 1;
  }
  std::ios::sync_with_stdio(false);
  int exit_code = 0;
  std::string line;
  std::vector<std::int32_t> ids;
  std::string out;
  for (std::size_t number = 1; std::getline(std::cin, line); ++number) {
    out.clear();
    if (decode) {
      if (runtime::parse_token_ids(line, ids)) {
        out = tokenizer->decode(ids, no_special_tokens);
      } else {
        std::cerr << "capserve-tokenize: line " << number << ": not a list of token ids\n";
        exit_code = 1;
      }
    } else if (const runtime::Status status = tokenizer->encode(line, !no_special_tokens, ids); status.ok()) {
      for (std::size_t i = 0; i < ids.size(); ++i) {
        if (i > 0) out.push_back(' ');
        out += std::to_string(ids[i]);
      }
    } else {
      std::cerr << "capserve-tokenize: line " << number << ": " << status.message() << "\n";
      exit_code = 1;
    }
    std::cout << out << '\n';
  }
  return exit_code;
}
