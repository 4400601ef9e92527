#include "server/step_plan.h"

#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace capserve::server {
namespace {

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vector(const std::vector<T>& v) {
    put(static_cast<std::uint64_t>(v.size()));
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    out.insert(out.end(), p, p + v.size() * sizeof(T));
  }
  void put_string(const std::string& s) {
    put(static_cast<std::uint64_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out.insert(out.end(), p, p + s.size());
  }
  std::vector<std::byte> out;
};

class Reader {
 public:
  explicit Reader(const std::vector<std::byte>& in) : in_(in) {}
  template <typename T>
  T get() {
    T v;
    take(&v, sizeof(T));
    return v;
  }
  template <typename T>
  void get_vector(std::vector<T>& v) {
    const auto n = get<std::uint64_t>();
    if (n > (in_.size() - pos_) / sizeof(T))
      throw std::runtime_error("step message: vector longer than the message");
    v.resize(static_cast<std::size_t>(n));
    take(v.data(), v.size() * sizeof(T));
  }
  std::string get_string() {
    std::vector<char> chars;
    get_vector(chars);
    return {chars.begin(), chars.end()};
  }
  void finish() const {
    if (pos_ != in_.size()) throw std::runtime_error("step message: trailing bytes");
  }

 private:
  void take(void* dst, std::size_t n) {
    if (n > in_.size() - pos_) throw std::runtime_error("step message: truncated");
    if (n > 0) std::memcpy(dst, in_.data() + pos_, n);
    pos_ += n;
  }
  const std::vector<std::byte>& in_;
  std::size_t pos_ = 0;
};

void put_params(Writer& w, const runtime::SamplingParams& p) {
  w.put(p.temperature);
  w.put(p.top_k);
  w.put(p.top_p);
  w.put(p.seed);
  w.put_vector(p.stop_token_ids);
  w.put(p.max_new_tokens);
  w.put(static_cast<std::uint8_t>(p.logprobs ? 1 : 0));
  w.put(static_cast<std::uint8_t>(p.prompt_logprobs ? 1 : 0));
  w.put(p.top_logprobs);
  w.put(p.min_p);
  w.put(p.min_tokens);
  w.put(p.presence_penalty);
  w.put(p.frequency_penalty);
  w.put(p.repetition_penalty);
  w.put_vector(p.logit_bias);
  w.put_string(p.constraint);
  w.put(static_cast<std::uint8_t>(p.protect ? 1 : 0));
}

runtime::SamplingParams get_params(Reader& r) {
  runtime::SamplingParams p;
  p.temperature = r.get<float>();
  p.top_k = r.get<std::int32_t>();
  p.top_p = r.get<float>();
  p.seed = r.get<std::uint64_t>();
  r.get_vector(p.stop_token_ids);
  p.max_new_tokens = r.get<std::int64_t>();
  p.logprobs = r.get<std::uint8_t>() != 0;
  p.prompt_logprobs = r.get<std::uint8_t>() != 0;
  p.top_logprobs = r.get<std::int32_t>();
  p.min_p = r.get<float>();
  p.min_tokens = r.get<std::int64_t>();
  p.presence_penalty = r.get<float>();
  p.frequency_penalty = r.get<float>();
  p.repetition_penalty = r.get<float>();
  r.get_vector(p.logit_bias);
  p.constraint = r.get_string();
  p.protect = r.get<std::uint8_t>() != 0;
  return p;
}

}  // namespace

std::vector<std::byte> serialize(const StepPlan& plan) {
  Writer w;
  w.put(static_cast<std::uint8_t>(plan.shutdown ? 1 : 0));
  w.put_vector(plan.frees);
  w.put(static_cast<std::uint64_t>(plan.starts.size()));
  for (const SequenceStart& s : plan.starts) {
    w.put(s.id);
    w.put(s.rank);
    w.put_vector(s.prompt);
    w.put(s.cached);
    put_params(w, s.params);
  }
  w.put_vector(plan.prefills);
  w.put_vector(plan.decodes);
  w.put_vector(plan.max_drafts);
  return std::move(w.out);
}

StepPlan deserialize_plan(const std::vector<std::byte>& bytes) {
  Reader r(bytes);
  StepPlan plan;
  plan.shutdown = r.get<std::uint8_t>() != 0;
  r.get_vector(plan.frees);
  const auto starts = r.get<std::uint64_t>();
  if (starts > bytes.size()) throw std::runtime_error("step message: too many sequences");
  plan.starts.resize(static_cast<std::size_t>(starts));
  for (SequenceStart& s : plan.starts) {
    s.id = r.get<std::uint64_t>();
    s.rank = r.get<std::int32_t>();
    r.get_vector(s.prompt);
    s.cached = r.get<std::int64_t>();
    s.params = get_params(r);
  }
  r.get_vector(plan.prefills);
  r.get_vector(plan.decodes);
  r.get_vector(plan.max_drafts);
  r.finish();
  if (!plan.max_drafts.empty() && plan.max_drafts.size() != plan.decodes.size())
    throw std::runtime_error("step message: draft limits do not match the decodes");
  return plan;
}

std::vector<std::byte> serialize(const StepResult& result) {
  Writer w;
  w.put(static_cast<std::uint8_t>(result.ok ? 1 : 0));
  w.put_string(result.error);
  w.put_vector(result.sequences);
  w.put_vector(result.tokens);
  w.put_vector(result.logprobs);
  w.put_vector(result.top_logprobs);
  return std::move(w.out);
}

StepResult deserialize_result(const std::vector<std::byte>& bytes) {
  Reader r(bytes);
  StepResult result;
  result.ok = r.get<std::uint8_t>() != 0;
  result.error = r.get_string();
  r.get_vector(result.sequences);
  r.get_vector(result.tokens);
  r.get_vector(result.logprobs);
  r.get_vector(result.top_logprobs);
  r.finish();
  std::size_t tokens = 0;
  for (const SequenceResult& s : result.sequences) {
    if (s.tokens < 0 || static_cast<std::size_t>(s.tokens) > result.tokens.size() - tokens)
      throw std::runtime_error("step message: more sequence tokens than the message holds");
    tokens += static_cast<std::size_t>(s.tokens);
  }
  if (tokens != result.tokens.size()) throw std::runtime_error("step message: tokens of no sequence");
  return result;
}

}  // namespace capserve::server
