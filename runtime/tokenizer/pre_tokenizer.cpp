#include "runtime/tokenizer/pre_tokenizer.h"

#include <algorithm>

namespace capserve::runtime {
namespace {

// The regex of HF's ByteLevel pre-tokenizer with use_regex (GPT-2's).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

// Applies one of HF's SplitDelimiterBehaviors to the (piece, is_match) segments of a split, given in order,
// emitting the resulting pieces in order. Mirrors NormalizedString::split's folds, streamed.
class PreTokenizer::Merger {
 public:
  explicit Merger(Behavior behavior) : behavior_(behavior) {}

  template <class Emit>
  Status push(std::size_t start, std::size_t end, bool is_match, Emit&& emit) {
    Status status;
    switch (behavior_) {
      case Behavior::isolated:
        return emit(start, end);
      case Behavior::removed:
        return is_match ? status : emit(start, end);
      case Behavior::merged_with_previous:
        // A match joins the piece before it when that piece was not a match.
        if (is_match && !previous_match_ && pending_) {
          pending_end_ = end;
        } else {
          status = flush(emit);
          hold(start, end);
        }
        break;
      case Behavior::merged_with_next:
        // A match joins the non-match right after it.
        if (pending_ && previous_match_ && !is_match) {
          pending_end_ = end;
          status = flush(emit);
        } else {
          status = flush(emit);
          if (status.ok()) hold(start, end);
          if (status.ok() && !is_match) status = flush(emit);
        }
        break;
      case Behavior::contiguous:
        if (pending_ && is_match == previous_match_) {
          pending_end_ = end;
        } else {
          status = flush(emit);
          hold(start, end);
        }
        break;
    }
    previous_match_ = is_match;
    return status;
  }

  template <class Emit>
  Status flush(Emit&& emit) {
    if (!pending_) return {};
    pending_ = false;
    return emit(pending_start_, pending_end_);
  }

 private:
  void hold(std::size_t start, std::size_t end) {
    pending_ = true;
    pending_start_ = start;
    pending_end_ = end;
  }

  Behavior behavior_;
  bool previous_match_ = false;
  bool pending_ = false;
  std::size_t pending_start_ = 0;
  std::size_t pending_end_ = 0;
};

PreTokenizer PreTokenizer::from_json(const std::optional<JsonAt>& spec) {
  PreTokenizer p;
  if (spec) p.add_steps(*spec);
  for (std::size_t i = 0; i + 1 < p.steps_.size(); ++i) {
    if (p.steps_[i].kind == Step::Kind::byte_level_split)
      spec->fail("a ByteLevel pre-tokenizer is only supported as the last step");
  }
  p.byte_level_ = !p.steps_.empty() && p.steps_.back().kind == Step::Kind::byte_level_split;
  return p;
}

void PreTokenizer::add_steps(const JsonAt& spec) {
  const std::string type = spec.type();
  Step step{};
  if (type == "Sequence") {
    const JsonAt list = spec.at("pretokenizers");
    list.require_array();
    for (std::size_t i = 0; i < list.json().size(); ++i) add_steps(list.at(i));
    return;
  }
  if (type == "Split") {
    step.kind = Step::Kind::split;
    const JsonAt pattern = spec.at("pattern");
    if (const auto regex = pattern.find("Regex")) {
      step.regex = std::make_shared<const Regex>(regex->string(), regex->path());
    } else if (const auto literal = pattern.find("String")) {
      if (literal->string().empty()) literal->fail("must not be empty");
      step.replacement = literal->string();
    } else {
      pattern.fail("must be {\"Regex\": ...} or {\"String\": ...}");
    }
    const JsonAt behavior = spec.at("behavior");
    const std::string name = behavior.string();
    if (name == "Removed") {
      step.behavior = Behavior::removed;
    } else if (name == "Isolated") {
      step.behavior = Behavior::isolated;
    } else if (name == "MergedWithPrevious") {
      step.behavior = Behavior::merged_with_previous;
    } else if (name == "MergedWithNext") {
      step.behavior = Behavior::merged_with_next;
    } else if (name == "Contiguous") {
      step.behavior = Behavior::contiguous;
    } else {
      behavior.fail("unknown split behavior '" + name + "'");
    }
    step.invert = spec.at("invert").boolean();
  } else if (type == "ByteLevel") {
    step.kind = Step::Kind::byte_level_split;
    step.add_prefix_space = spec.at("add_prefix_space").boolean();
    if (spec.boolean_or("use_regex", true)) {
      step.regex = std::make_shared<const Regex>(kGpt2Pattern, spec.path() + " (the GPT-2 regex)");
    }
  } else if (type == "Metaspace") {
    step.kind = Step::Kind::metaspace;
    step.replacement = spec.at("replacement").character();
    const std::string scheme = spec.string_or("prepend_scheme", "always");
    if (scheme == "always") {
      step.prepend = Prepend::always;
    } else if (scheme == "first") {
      step.prepend = Prepend::first;
    } else if (scheme == "never") {
      step.prepend = Prepend::never;
    } else {
      spec.at("prepend_scheme").fail("unknown prepend_scheme '" + scheme + "'");
    }
    // The legacy flag: HF accepts add_prefix_space=false only together with prepend_scheme "never".
    if (!spec.boolean_or("add_prefix_space", true)) {
      if (step.prepend != Prepend::never)
        spec.at("add_prefix_space").fail("add_prefix_space does not match declared prepend_scheme");
    }
    step.split = spec.boolean_or("split", true);
  } else {
    spec.at("type").fail("unsupported pre_tokenizer type '" + type + "'");
  }
  steps_.push_back(std::move(step));
}

bool PreTokenizer::has_metaspace_first() const {
  return std::any_of(steps_.begin(), steps_.end(), [](const Step& s) {
    return s.kind == Step::Kind::metaspace && s.prepend == Prepend::first;
  });
}

Status PreTokenizer::run(std::string_view text, bool at_start, PreTokenizerScratch& scratch,
                         WordSink& sink) const {
  if (scratch.buffers.size() < steps_.size()) scratch.buffers.resize(steps_.size());
  return run_step(0, text, at_start, scratch, sink);
}

Status PreTokenizer::run_step(std::size_t index, std::string_view piece, bool at_start,
                              PreTokenizerScratch& scratch, WordSink& sink) const {
  if (piece.empty()) return {};  // HF drops empty pieces
  if (index == steps_.size()) {
    sink.word(piece);
    return {};
  }
  const Step& step = steps_[index];
  std::string& buffer = scratch.buffers[index];
  switch (step.kind) {
    case Step::Kind::split:
      return split(index, piece, at_start, step, scratch, sink);
    case Step::Kind::byte_level_split:
      if (step.add_prefix_space && piece.front() != ' ') {
        buffer.assign(1, ' ');
        buffer.append(piece);
        piece = buffer;
      }
      return step.regex ? split(index, piece, at_start, step, scratch, sink)
                        : run_step(index + 1, piece, at_start, scratch, sink);
    case Step::Kind::metaspace: {
      buffer.clear();
      const bool prepend = !piece.starts_with(step.replacement) && !piece.starts_with(' ') &&
                           (step.prepend == Prepend::always || (step.prepend == Prepend::first && at_start));
      if (prepend) buffer.append(step.replacement);
      for (const char c : piece) {
        if (c == ' ') {
          buffer.append(step.replacement);
        } else {
          buffer.push_back(c);
        }
      }
      return step.split ? split(index, buffer, at_start, step, scratch, sink)
                        : run_step(index + 1, buffer, at_start, scratch, sink);
    }
  }
  return {};
}

Status PreTokenizer::split(std::size_t index, std::string_view piece, bool at_start, const Step& step,
                           PreTokenizerScratch& scratch, WordSink& sink) const {
  // Metaspace splits on its replacement, each occurrence a match merged with what follows.
  const bool metaspace = step.kind == Step::Kind::metaspace;
  Merger merger(metaspace ? Behavior::merged_with_next : step.behavior);
  const auto emit = [&](std::size_t start, std::size_t end) {
    return run_step(index + 1, piece.substr(start, end - start), at_start && start == 0, scratch, sink);
  };
  const std::string_view literal = step.replacement;
  std::size_t previous = 0;
  RegexMatch match;
  Status status;
  while (status.ok() && previous < piece.size()) {
    if (step.regex) {
      status = step.regex->find(piece, previous, scratch.regex, match);
      if (!status.ok()) return status;
    } else {
      const std::size_t hit = piece.find(literal, previous);
      match = {hit, hit + literal.size(), hit != std::string_view::npos};
    }
    if (!match.found) break;
    if (match.start != previous) status = merger.push(previous, match.start, step.invert, emit);
    if (status.ok()) status = merger.push(match.start, match.end, !step.invert, emit);
    previous = match.end;
  }
  if (status.ok() && previous != piece.size())
    status = merger.push(previous, piece.size(), step.invert, emit);
  if (status.ok()) status = merger.flush(emit);
  return status;
}

}  // namespace capserve::runtime
