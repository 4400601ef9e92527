#include "kernels/backend.h"

#include <stdexcept>
#include <string>

namespace capserve::kernels {

std::string_view host_sync_name(HostSync why) {
  switch (why) {
    case HostSync::sampled_tokens:
      return "sampled_tokens";
    case HostSync::moe_dispatch:
      return "moe_dispatch";
    case HostSync::moe_groups:
      return "moe_groups";
    case HostSync::moe_stats:
      return "moe_stats";
    case HostSync::logits:
      return "logits";
    case HostSync::dry_run:
      return "dry_run";
    case HostSync::logprobs:
      return "logprobs";
    case HostSync::count_:
      break;
  }
  return "?";
}

Tensor Backend::scratch(Buffer& slot, DType dtype, std::initializer_list<std::int64_t> shape) {
  const Tensor wanted(nullptr, dtype, device(), shape);
  if (slot.bytes() < wanted.bytes() || slot.device() != device()) {
    if (scratch_sealed_) {
      throw std::length_error("step scratch: " + wanted.shape_text() + " " + std::string(dtype_name(dtype)) +
                              " needs " + std::to_string(wanted.bytes()) + " bytes, its buffer has " +
                              std::to_string(slot.bytes()) +
                              " (sized at start-up for the engine's largest step, max_step_tokens)");
    }
    slot = allocate(wanted.bytes());
  }
  return slot.view(dtype, shape);
}

namespace {

void check_copy(const char* what, const Tensor& tensor, std::size_t host_bytes, const Device& backend) {
  if (tensor.device() != backend) {
    throw std::invalid_argument(std::string("Backend::") + what + ": a tensor on " +
                                to_string(tensor.device()) + ", the backend is on " + to_string(backend));
  }
  if (host_bytes != tensor.bytes()) {
    throw std::invalid_argument(std::string("Backend::") + what + ": " + std::to_string(host_bytes) +
                                " host bytes for a tensor of " + std::to_string(tensor.bytes()));
  }
}

}  // namespace

void Backend::to_host(const Tensor& src, std::span<std::byte> dst, HostSync why) {
  check_copy("to_host", src, dst.size(), device());
  copy_to_host(src, dst);
  copies_outstanding_ = false;
  ++host_syncs_[static_cast<std::size_t>(why)];
}

void Backend::to_host_later(const Tensor& src, std::span<std::byte> dst) {
  check_copy("to_host_later", src, dst.size(), device());
  copies_outstanding_ = copy_to_host_later(src, dst) || copies_outstanding_;
}

void Backend::finish_host_copies(HostSync why) {
  if (!copies_outstanding_) return;
  finish_copies_to_host();
  copies_outstanding_ = false;
  ++host_syncs_[static_cast<std::size_t>(why)];
}

void Backend::from_host(std::span<const std::byte> src, const Tensor& dst) {
  check_copy("from_host", dst, src.size(), device());
  copy_from_host(src, dst);
}

LogprobShape logprob_shape(const Tensor& logits, const Tensor& tokens, const Tensor& values,
                           const Tensor& top_ids) {
  const LogprobShape s{logits.dims() == 0 ? 0 : logits.dim(0), logits.row_numel(),
                       top_ids.dims() == 2 ? top_ids.dim(1) : 0};
  const bool fits = logits.dims() == 2 && logits.dtype() == DType::f32 && tokens.dtype() == DType::i32 &&
                    tokens.numel() == s.rows && values.dtype() == DType::f32 && values.dims() == 2 &&
                    values.dim(0) == s.rows && values.dim(1) == 1 + s.top_k &&
                    top_ids.dtype() == DType::i32 && top_ids.dims() == 2 && top_ids.dim(0) == s.rows &&
                    s.top_k <= s.vocab;
  if (!fits) {
    throw std::invalid_argument(
        "token_logprobs: logits " + logits.shape_text() + " " + std::string(dtype_name(logits.dtype())) +
        ", tokens " + tokens.shape_text() + ", values " + values.shape_text() + ", top_ids " +
        top_ids.shape_text() +
        " (want f32 [rows, vocab], int32 [rows], f32 [rows, 1 + k], int32 [rows, k], k "
        "<= vocab)");
  }
  return s;
}

DispatchShape dispatch_shape(const Tensor& experts, const Tensor& weights, const DispatchPlan& plan) {
  DispatchShape d{experts.dims() == 0 ? 0 : experts.dim(0), experts.row_numel(),
                  plan.row_offsets.numel() - 1};
  const std::int64_t slots = d.tokens * d.top_k;
  if (d.ranks < 1 || plan.entry_offsets.numel() != d.ranks + 1 || plan.counts.numel() != 2 * d.ranks)
    throw std::invalid_argument("plan_dispatch: offsets of ranks + 1 and counts of 2 * ranks, not " +
                                plan.row_offsets.shape_text() + ", " + plan.entry_offsets.shape_text() +
                                ", " + plan.counts.shape_text());
  if (weights.numel() != slots || plan.row_position.numel() != slots || plan.row_token.numel() < slots ||
      plan.entries.bytes() < static_cast<std::size_t>(slots) * sizeof(moe::DispatchEntry))
    throw std::invalid_argument("plan_dispatch: plan tensors smaller than experts " + experts.shape_text());
  return d;
}

namespace {

void check_range(IndexRange r, std::size_t size, const char* what) {
  if (r.begin < 0 || r.end < r.begin || static_cast<std::size_t>(r.end) > size)
    throw std::invalid_argument(std::string("sample: a row's ") + what + " range [" +
                                std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                ") lies outside its " + std::to_string(size) + " entries");
}

}  // namespace

void check_sample_ranges(const SampleControls& c, const SampleInputs& inputs) {
  check_range(c.banned, inputs.banned.size(), "banned ids");
  check_range(c.bias, inputs.biases.size(), "logit_bias");
  check_range(c.history, inputs.history.size(), "history");
}

bool adjusts_row(const SampleInputs& inputs, std::size_t r) {
  const SampleControls& c = inputs.controls[r];
  return !inputs.allowed.empty() || c.banned.end > c.banned.begin || c.bias.end > c.bias.begin ||
         c.penalized();
}

}  // namespace capserve::kernels
