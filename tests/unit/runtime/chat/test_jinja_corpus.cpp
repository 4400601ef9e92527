// The Jinja2 engine against Python Jinja2 over the real chat-template corpus (../shared/data/chat_templates,
// README there): every (template, scenario) that Jinja2 rendered renders byte-identical, and every one where
// Jinja2 raised raises the same Python exception class.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/chat/jinja_json.h"
#include "runtime/chat/jinja_template.h"
#include "tests/unit/runtime/chat/chat_test_data.h"

namespace capserve::runtime::jinja {
namespace {

using Json = nlohmann::ordered_json;

using runtime::testing::corpus_dir;

std::vector<Json> read_jsonl(const std::filesystem::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot open " << path << " (set CAPSERVE_SHARED_DATA_DIR to the shared data folder)";
  std::vector<Json> records;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) records.push_back(Json::parse(line));
  }
  return records;
}

bool applies(const Json& scenario, const std::string& source) {
  const Json& need = scenario.at("applies_if_template_contains");
  if (need.is_null()) return true;
  for (const Json& s : need) {
    if (source.find(s.get<std::string>()) != std::string::npos) return true;
  }
  return false;
}

// The variables render_goldens.py passes: special tokens, then the scenario's kwargs, with messages, tools
// (None when absent), documents (None) and add_generation_prompt always present.
Dict context_for(const Json& template_record, const Json& scenario, const Json& tools) {
  Dict context;
  for (const auto& [key, value] : template_record.at("special_tokens").items()) {
    static const std::string kNamed[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                         "pad_token", "cls_token", "mask_token"};
    if (!value.is_null() && std::find(std::begin(kNamed), std::end(kNamed), key) != std::end(kNamed)) {
      context.set(key, from_json(value));
    }
  }
  context.set("tools", None{});
  context.set("documents", None{});
  context.set("add_generation_prompt", false);
  for (const auto& [key, value] : scenario.at("kwargs").items()) {
    context.set(key, value == "$tools" ? from_json(tools) : from_json(value));
  }
  return context;
}

// The counts come from the corpus files, so that another corpus (CAPSERVE_SHARED_DATA_DIR) is checked as this
// one is: every render in renders.jsonl is compared, and a template that does not compile fails each of its
// renders (unless Jinja2 raised the same class for it too) instead of leaving the count.
TEST(JinjaCorpus, RendersLikePythonJinja2) {
  const std::filesystem::path dir = corpus_dir();
  const std::vector<Json> templates = read_jsonl(dir / "templates.jsonl");
  const std::vector<Json> renders = read_jsonl(dir / "renders.jsonl");
  std::ifstream scenarios_in(dir / "scenarios.json");
  ASSERT_TRUE(scenarios_in) << "cannot open " << dir / "scenarios.json";
  const Json spec = Json::parse(scenarios_in);
  ASSERT_FALSE(templates.empty());
  ASSERT_FALSE(renders.empty());

  std::map<std::pair<std::string, std::string>, const Json*> golden;
  for (const Json& r : renders) {
    golden[{r.at("template_id").get<std::string>(), r.at("scenario").get<std::string>()}] = &r;
  }

  RenderOptions options;
  options.now = runtime::testing::frozen_now;
  int rendered_ok = 0;
  int raised_ok = 0;
  int compared = 0;
  int not_compiled = 0;
  int reported = 0;
  for (const Json& t : templates) {
    const std::string id = t.at("id").get<std::string>();
    const std::string source = t.at("chat_template").get<std::string>();
    std::unique_ptr<Template> compiled;
    std::optional<Error> compile_error;
    try {
      compiled = std::make_unique<Template>(source);
    } catch (const Error& e) {
      compile_error = e;
      ++not_compiled;
    }
    for (const Json& scenario : spec.at("scenarios")) {
      if (!applies(scenario, source)) continue;
      const std::string name = scenario.at("name").get<std::string>();
      const auto it = golden.find({id, name});
      if (it == golden.end()) {
        ADD_FAILURE() << id << " / " << name << ": no golden";
        continue;
      }
      ++compared;
      const Json& expected = *it->second;
      std::string output;
      std::string error_class_name;
      std::string error_text;
      if (compile_error) {
        error_class_name = std::string(error_class(compile_error->kind()));
        error_text = std::string("does not compile: ") + compile_error->what();
      } else {
        try {
          output = compiled->render(context_for(t, scenario, spec.at("tools")), options).text;
        } catch (const Error& e) {
          error_class_name = std::string(error_class(e.kind()));
          error_text = e.what();
        } catch (const std::exception& e) {
          error_class_name = "C++ exception";
          error_text = e.what();
        }
      }
      const bool want_ok = expected.at("ok").get<bool>();
      if (want_ok && error_class_name.empty() && output == expected.at("output").get<std::string>()) {
        ++rendered_ok;
        continue;
      }
      if (!want_ok && error_class_name == expected.at("error").at("type").get<std::string>()) {
        ++raised_ok;
        continue;
      }
      if (reported++ < 40) {
        ADD_FAILURE() << id << " / " << name << ":\n  expected "
                      << (want_ok ? "output " + expected.at("output").dump()
                                  : "error " + expected.at("error").dump())
                      << "\n  got "
                      << (error_class_name.empty() ? "output " + Json(output).dump() : error_text);
      }
    }
  }
  const auto want_rendered =
      std::count_if(renders.begin(), renders.end(), [](const Json& r) { return r.at("ok").get<bool>(); });
  const auto want_raised = static_cast<std::ptrdiff_t>(renders.size()) - want_rendered;
  std::cout << "chat-template corpus: " << rendered_ok + raised_ok << " of " << renders.size()
            << " renders of " << templates.size() << " templates match (" << rendered_ok << " of "
            << want_rendered << " renders byte-identical, " << raised_ok << " of " << want_raised
            << " raises of the same class; " << not_compiled << " templates do not compile)\n";
  EXPECT_EQ(compared, static_cast<std::ptrdiff_t>(renders.size()))
      << "renders.jsonl holds renders no scenario applies to";
  EXPECT_EQ(rendered_ok, want_rendered);
  EXPECT_EQ(raised_ok, want_raised);
}

}  // namespace
}  // namespace capserve::runtime::jinja
