#include "runtime/tokenizer/post_processor.h"

#include <limits>

namespace capserve::runtime {

PostProcessor PostProcessor::from_json(const std::optional<JsonAt>& spec) {
  PostProcessor p;
  if (spec) p.add(*spec);
  return p;
}

void PostProcessor::add(const JsonAt& spec) {
  const std::string type = spec.type();
  if (type == "Sequence") {
    const JsonAt list = spec.at("processors");
    list.require_array();
    for (std::size_t i = 0; i < list.json().size(); ++i) add(list.at(i));
  } else if (type == "TemplateProcessing") {
    add_template(spec);
  } else if (type != "ByteLevel") {  // ByteLevel only trims offsets
    spec.at("type").fail("unsupported post_processor type '" + type + "'");
  }
}

void PostProcessor::add_template(const JsonAt& spec) {
  const JsonAt single = spec.at("single");
  single.require_array();
  const JsonAt special_tokens = spec.at("special_tokens");
  // A later processor in a Sequence wraps what the earlier ones produced.
  std::vector<std::int32_t> before;
  std::vector<std::int32_t> after;
  bool seen_sequence = false;
  for (std::size_t i = 0; i < single.json().size(); ++i) {
    const JsonAt piece = single.at(i);
    if (const auto sequence = piece.find("Sequence")) {
      if (seen_sequence || sequence->at("id").string() != "A")
        sequence->fail("a single-sequence template must contain sequence A exactly once");
      seen_sequence = true;
    } else if (const auto special = piece.find("SpecialToken")) {
      const std::string name = special->at("id").string();
      const auto entry = special_tokens.find(name);
      if (!entry) special->fail("special token '" + name + "' is not in special_tokens");
      const JsonAt ids = entry->at("ids");
      ids.require_array();
      for (std::size_t k = 0; k < ids.json().size(); ++k) {
        const std::int64_t id = ids.at(k).integer();
        if (id < 0 || id > std::numeric_limits<std::int32_t>::max()) ids.at(k).fail("id out of range");
        (seen_sequence ? after : before).push_back(static_cast<std::int32_t>(id));
      }
    } else {
      piece.fail("must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
  }
  if (!seen_sequence) single.fail("a single-sequence template must contain sequence A");
  prefix_.insert(prefix_.begin(), before.begin(), before.end());
  suffix_.insert(suffix_.end(), after.begin(), after.end());
}

}  // namespace capserve::runtime
