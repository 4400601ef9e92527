#include "server/grpc_requests.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/tokenizer/utf8.h"
#include "server/client_json.h"
#include "server/request_intake.h"

namespace capserve::server {
namespace {

namespace v1 = capserve::v1;
using runtime::StatusOr;

SamplingInput sampling_input(const v1::SamplingOptions& s) {
  SamplingInput in;
  if (s.has_temperature()) in.temperature = s.temperature();
  if (s.has_top_p()) in.top_p = s.top_p();
  if (s.has_top_k()) in.top_k = s.top_k();
  in.max_tokens = s.max_tokens();
  in.seed = s.seed();
  in.stop.assign(s.stop().begin(), s.stop().end());
  in.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  in.ignore_eos = s.ignore_eos();
  in.logprobs = s.logprobs();
  in.prompt_logprobs = s.prompt_logprobs();
  in.top_logprobs = s.top_logprobs();
  if (s.has_min_p()) in.min_p = s.min_p();
  in.min_tokens = s.min_tokens();
  in.presence_penalty = s.presence_penalty();
  in.frequency_penalty = s.frequency_penalty();
  if (s.has_repetition_penalty()) in.repetition_penalty = s.repetition_penalty();
  in.capacity_class = s.capacity_class();
  // Sorted by id: a protobuf map's order is unspecified, and the same request should be the same params.
  for (const auto& [id, bias] : s.logit_bias()) in.logit_bias.push_back({id, bias});
  std::sort(in.logit_bias.begin(), in.logit_bias.end(),
            [](const kernels::LogitBias& a, const kernels::LogitBias& b) { return a.token < b.token; });
  return in;
}

// sampling.output_constraint in runtime/grammar's parse_constraint spelling.
StatusOr<std::optional<ConstraintInput>> constraint_input(const v1::SamplingOptions& sampling) {
  if (!sampling.has_output_constraint()) return std::optional<ConstraintInput>();
  const v1::OutputConstraint& c = sampling.output_constraint();
  const std::string field = "sampling.output_constraint";
  const auto text = [&](const std::string& value, const std::string& kind) -> StatusOr<std::string> {
    if (runtime::utf8::is_valid(value)) return value;
    return runtime::Status::invalid_argument(field + "." + kind + ": not valid UTF-8", field);
  };
  nlohmann::ordered_json spec = nlohmann::ordered_json::object();
  switch (c.kind_case()) {
    case v1::OutputConstraint::kJsonSchema: {
      StatusOr<nlohmann::ordered_json> schema = parse_json_field(c.json_schema(), field + ".json_schema");
      if (!schema.ok()) return std::move(schema).take_status();
      spec["json_schema"] = std::move(*schema);
      break;
    }
    case v1::OutputConstraint::kJsonObject:
      if (!c.json_object())
        return runtime::Status::invalid_argument(field + ".json_object: must be true", field);
      spec["json_object"] = true;
      break;
    case v1::OutputConstraint::kRegex:
    case v1::OutputConstraint::kGrammar: {
      const bool regex = c.kind_case() == v1::OutputConstraint::kRegex;
      StatusOr<std::string> value = text(regex ? c.regex() : c.grammar(), regex ? "regex" : "grammar");
      if (!value.ok()) return std::move(value).take_status();
      spec[regex ? "regex" : "grammar"] = std::move(*value);
      break;
    }
    case v1::OutputConstraint::kChoice: {
      nlohmann::ordered_json& choices = spec["choice"] = nlohmann::ordered_json::array();
      for (const std::string& choice : c.choice().choices()) {
        StatusOr<std::string> value = text(choice, "choice");
        if (!value.ok()) return std::move(value).take_status();
        choices.push_back(std::move(*value));
      }
      break;
    }
    case v1::OutputConstraint::KIND_NOT_SET:
      return runtime::Status::invalid_argument(
          field + ": set one of json_schema, json_object, regex, choice, grammar", field);
  }
  if (!c.any_whitespace() && (spec.contains("json_schema") || spec.contains("json_object")))
    spec["whitespace"] = "compact";
  return std::optional<ConstraintInput>(ConstraintInput{std::move(spec), field});
}

// What every call shares: model, request id, sampling (spelt "sampling.*"), output constraint, peer and
// deadline.
StatusOr<IntakeRequest> intake_request(CallOrigin origin, const std::string& model,
                                       const std::string& request_id, const v1::SamplingOptions& sampling) {
  IntakeRequest r;
  r.model = model;
  r.request_id = request_id;
  r.sampling = sampling_input(sampling);
  StatusOr<std::optional<ConstraintInput>> constraint = constraint_input(sampling);
  if (!constraint.ok()) return std::move(constraint).take_status();
  r.constraint = std::move(*constraint);
  r.fields.sampling_prefix = "sampling.";
  r.peer = std::move(origin.peer);
  r.deadline = origin.deadline;
  return r;
}

}  // namespace

StatusOr<IntakeRequest> chat_intake_request(const v1::ChatRequest& request, CallOrigin origin) {
  StatusOr<IntakeRequest> call =
      intake_request(std::move(origin), request.model(), request.request_id(), request.sampling());
  if (!call.ok()) return call;
  IntakeRequest& r = *call;
  ChatPrompt chat;
  chat.messages.reserve(static_cast<std::size_t>(request.messages_size()));
  for (int i = 0; i < request.messages_size(); ++i) {
    const v1::ChatMessage& m = request.messages(i);
    const std::string at = "messages[" + std::to_string(i) + "]";
    runtime::ChatMessage message{m.role(), m.content()};
    if (!m.tool_calls().empty()) {
      StatusOr<nlohmann::ordered_json> calls = parse_json_field(m.tool_calls(), at + ".tool_calls");
      if (!calls.ok()) return std::move(calls).take_status();
      message.fields["tool_calls"] = std::move(*calls);
      if (m.content().empty()) {
        message.content.reset();
        message.fields["content"] = nullptr;
      }
    }
    if (!m.tool_call_id().empty()) message.fields["tool_call_id"] = m.tool_call_id();
    if (!m.name().empty()) message.fields["name"] = m.name();
    chat.messages.push_back(std::move(message));
  }
  if (request.has_add_generation_prompt())
    chat.inputs.add_generation_prompt = request.add_generation_prompt();
  if (!request.tools().empty()) {
    StatusOr<nlohmann::ordered_json> tools = parse_json_field(request.tools(), "tools");
    if (!tools.ok()) return std::move(tools).take_status();
    chat.inputs.tools = std::move(*tools);
  }
  if (!request.chat_template_kwargs().empty()) {
    StatusOr<nlohmann::ordered_json> kwargs =
        parse_json_field(request.chat_template_kwargs(), "chat_template_kwargs");
    if (!kwargs.ok()) return std::move(kwargs).take_status();
    chat.inputs.kwargs = std::move(*kwargs);
  }
  r.prompts.push_back({std::move(chat), "messages"});
  r.fields.context = "messages";
  return call;
}

StatusOr<IntakeRequest> generate_intake_request(const v1::GenerateRequest& request, CallOrigin origin) {
  StatusOr<IntakeRequest> call =
      intake_request(std::move(origin), request.model(), request.request_id(), request.sampling());
  if (!call.ok()) return call;
  IntakeRequest& r = *call;
  r.fields.context = "input_ids";
  // Built in place: GCC 12 at -O3 misreads a moved temporary's variant as reading the other alternatives.
  r.prompts.emplace_back().field = "input_ids";
  r.prompts.back().content =
      TokenPrompt{std::vector<std::int32_t>(request.input_ids().begin(), request.input_ids().end())};
  r.text_output = false;
  return call;
}

}  // namespace capserve::server
