#include "runtime/weights/checkpoint.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>

#include "kernels/cpu/weight_convert.h"
#include "runtime/load_error.h"

namespace capserve::runtime {

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr std::size_t kMaxListedUnused = 20;

bool is_plain_file(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec);
}

// A shard name must be a plain file name directly inside the checkpoint directory.
bool is_plain_file_name(const std::string& name) {
  if (name.empty() || name == "." || name == "..") return false;
  return name.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos;
}

std::vector<SafetensorsFile> open_sharded(const std::filesystem::path& dir,
                                          const std::filesystem::path& index_path) {
  const std::string where = "checkpoint index " + index_path.string();
  std::ifstream in(index_path, std::ios::binary);
  if (!in) throw LoadError(where + ": cannot open");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad()) throw LoadError(where + ": read error");

  // nlohmann stops at a NUL byte as if the input ended there; strict JSON has no raw NUL anywhere.
  const auto index = text.find('\0') == std::string::npos
                         ? nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false)
                         : nlohmann::json(nlohmann::json::value_t::discarded);
  if (index.is_discarded()) throw LoadError(where + ": not valid JSON");
  if (!index.is_object()) throw LoadError(where + ": must be a JSON object, got " + index.type_name());
  const auto wm_it = index.find("weight_map");
  if (wm_it == index.end()) throw LoadError(where + ": missing \"weight_map\"");
  if (!wm_it->is_object()) {
    throw LoadError(where + ": \"weight_map\" must be an object, got " + std::string(wm_it->type_name()));
  }

  // tensor -> shard file name, and the shard file names in sorted order.
  std::map<std::string, std::string> listed;
  std::map<std::string, std::size_t> shard_index;
  for (const auto& [tensor, shard] : wm_it->items()) {
    if (!shard.is_string()) {
      throw LoadError(where + ": shard for tensor '" + tensor + "' must be a string, got " +
                      shard.type_name());
    }
    const auto& file = shard.get_ref<const std::string&>();
    if (!is_plain_file_name(file)) {
      throw LoadError(where + ": shard '" + file + "' for tensor '" + tensor +
                      "' must be a plain file name inside " + dir.string());
    }
    if (!is_plain_file(dir / file)) {
      throw LoadError(where + ": shard '" + file + "' for tensor '" + tensor + "' does not exist in " +
                      dir.string());
    }
    listed.emplace(tensor, file);
    shard_index.emplace(file, 0);
  }

  std::vector<SafetensorsFile> files;
  files.reserve(shard_index.size());
  for (auto& [file, idx] : shard_index) {
    idx = files.size();
    files.push_back(SafetensorsFile::open(dir / file));
  }

  // No tensor is stored in two shards.
  std::map<std::string_view, const std::string*> holder;
  for (const auto& [file, idx] : shard_index) {
    for (const auto& t : files[idx].tensors()) {
      const auto [it, inserted] = holder.emplace(t.name, &file);
      if (!inserted) {
        throw LoadError(where + ": tensor '" + t.name + "' is present in two shards, '" + *it->second +
                        "' and '" + file + "'");
      }
    }
  }
  // Every tensor the index lists is in its shard.
  for (const auto& [tensor, file] : listed) {
    if (files[shard_index.at(file)].find(tensor) == nullptr) {
      throw LoadError(where + ": tensor '" + tensor + "' is listed in shard '" + file + "' but " +
                      (dir / file).string() + " does not contain it");
    }
  }
  // Every tensor in a shard is listed in the index, under that shard.
  for (const auto& [file, idx] : shard_index) {
    for (const auto& t : files[idx].tensors()) {
      const auto it = listed.find(t.name);
      if (it == listed.end()) {
        throw LoadError(where + ": tensor '" + t.name + "' in shard '" + file +
                        "' is not listed in the index");
      }
      if (it->second != file) {
        throw LoadError(where + ": tensor '" + t.name + "' is present in shard '" + file +
                        "' but the index places it in shard '" + it->second + "'");
      }
    }
  }
  return files;
}

}  // namespace

Checkpoint::Checkpoint(std::filesystem::path dir, std::vector<SafetensorsFile> files,
                       std::optional<Fp8BlockShape> fp8)
    : dir_(std::move(dir)), files_(std::move(files)), fp8_(fp8) {
  for (std::size_t i = 0; i < files_.size(); ++i) {
    for (const auto& t : files_[i].tensors()) {
      const auto [it, inserted] = by_name_.emplace(t.name, &t);
      if (!inserted) {
        throw LoadError("checkpoint " + dir_.string() + ": tensor '" + t.name + "' is present in both " +
                        files_[file_of_.at(t.name)].path().string() + " and " + files_[i].path().string());
      }
      file_of_.emplace(t.name, i);
    }
  }
}

Checkpoint Checkpoint::open(const std::filesystem::path& dir, std::optional<Fp8BlockShape> fp8) {
  const auto index_path = dir / kIndexFile;
  if (is_plain_file(index_path)) return Checkpoint(dir, open_sharded(dir, index_path), fp8);
  const auto single_path = dir / kSingleFile;
  if (is_plain_file(single_path)) {
    std::vector<SafetensorsFile> files;
    files.push_back(SafetensorsFile::open(single_path));
    return Checkpoint(dir, std::move(files), fp8);
  }
  throw LoadError(std::string("no ") + kSingleFile + " or " + kIndexFile + " in " + dir.string());
}

bool Checkpoint::contains(std::string_view name) const {
  return by_name_.contains(std::string(name));
}

const TensorInfo& Checkpoint::checked(std::string_view name, const std::vector<std::int64_t>& expected) {
  const std::string key(name);
  const auto it = by_name_.find(key);
  if (it == by_name_.end()) {
    throw LoadError("tensor '" + key + "' not found in checkpoint " + dir_.string());
  }
  const TensorInfo& t = *it->second;
  if (t.shape != expected) {
    throw LoadError("tensor '" + key + "' in " + files_[file_of_.at(key)].path().string() + " has shape " +
                    shape_text(t.shape) + ", expected " + shape_text(expected));
  }
  if (t.dtype == kernels::DType::f8_e4m3) fp8_scale_of(key, t);
  used_.insert(key);
  return t;
}

const TensorInfo& Checkpoint::fp8_scale_of(const std::string& name, const TensorInfo& weight) {
  const std::string where = "tensor '" + name + "' in " + files_[file_of_.at(name)].path().string();
  if (!fp8_) {
    throw LoadError(where + " is stored as F8_E4M3 but config.json has no FP8 quantization_config");
  }
  if (weight.shape.size() != 2) {
    throw LoadError(where + ": an F8_E4M3 tensor must be a matrix, not " + shape_text(weight.shape));
  }
  const std::string scale_name = name + "_scale_inv";
  const auto it = by_name_.find(scale_name);
  if (it == by_name_.end())
    throw LoadError(where + " is stored as F8_E4M3 but '" + scale_name + "' is missing");
  const TensorInfo& scale = *it->second;
  const std::vector<std::int64_t> scale_shape{fp8_scale_rows(weight.shape[0], *fp8_),
                                              fp8_scale_cols(weight.shape[1], *fp8_)};
  if (scale.shape != scale_shape) {
    throw LoadError("tensor '" + scale_name + "' has shape " + shape_text(scale.shape) + ", expected " +
                    shape_text(scale_shape) + " (one scale per " + std::to_string(fp8_->rows) + "x" +
                    std::to_string(fp8_->cols) + " block of " + shape_text(weight.shape) + ")");
  }
  if (scale.dtype != kernels::DType::f32 && scale.dtype != kernels::DType::bf16) {
    throw LoadError("tensor '" + scale_name + "' is stored as " +
                    std::string(kernels::dtype_name(scale.dtype)) + "; block scales must be F32 or BF16");
  }
  used_.insert(scale_name);
  return scale;
}

kernels::WeightView Checkpoint::get_stored(std::string_view name, std::initializer_list<std::int64_t> shape) {
  const std::vector<std::int64_t> expected(shape);
  const TensorInfo& t = checked(name, expected);

  kernels::WeightView view;
  view.dtype = t.dtype;
  view.data = t.data;
  if (expected.empty()) {
    view.rows = 1;
    view.cols = 1;
  } else {
    view.cols = expected.back();
    view.rows = 1;
    for (std::size_t i = 0; i + 1 < expected.size(); ++i) {
      // Only reachable with a zero dimension elsewhere (a non-empty tensor's element count fits in its file).
      if (__builtin_mul_overflow(view.rows, expected[i], &view.rows)) {
        throw LoadError("tensor '" + std::string(name) + "' in " +
                        files_[file_of_.at(std::string(name))].path().string() + ": shape " +
                        shape_text(expected) + " has too many rows");
      }
    }
  }
  if (t.dtype == kernels::DType::f8_e4m3) {
    const TensorInfo& scale = fp8_scale_of(std::string(name), t);
    view.scales = {scale.dtype, scale.data, fp8_->rows, fp8_->cols};
  }
  return view;
}

kernels::WeightView Checkpoint::get(std::string_view name, std::initializer_list<std::int64_t> shape) {
  kernels::WeightView view = get_stored(name, shape);
  if (view.dtype != kernels::DType::f8_e4m3) return view;
  const std::string key(name);
  const TensorInfo& t = *by_name_.at(key);
  std::vector<std::uint16_t> bf16(static_cast<std::size_t>(view.numel()));
  dequantize_fp8_blocks(t, fp8_scale_of(key, t), *fp8_, bf16);
  view = {kernels::DType::bf16, reinterpret_cast<const std::byte*>(bf16.data()), view.rows, view.cols};
  dequantized_.emplace(view.data, std::move(bf16));
  return view;
}

kernels::WeightView Checkpoint::get_f32(std::string_view name, std::initializer_list<std::int64_t> shape) {
  const kernels::WeightView stored = get(name, shape);
  if (stored.dtype == kernels::DType::f32) return stored;
  std::vector<float> wide(static_cast<std::size_t>(stored.numel()));
  kernels::cpu::convert_to_f32(stored.dtype, stored.data, 0, stored.numel(), wide.data());
  release(stored);
  const kernels::WeightView view{kernels::DType::f32, reinterpret_cast<const std::byte*>(wide.data()),
                                 stored.rows, stored.cols};
  widened_.emplace(view.data, std::move(wide));
  return view;
}

void Checkpoint::check(std::string_view name, std::initializer_list<std::int64_t> shape) {
  checked(name, std::vector<std::int64_t>(shape));
}

void Checkpoint::release(const kernels::WeightView& view) {
  dequantized_.erase(view.data);
  widened_.erase(view.data);
}

void Checkpoint::check_all_used() const {
  std::vector<std::pair<std::string, std::string>> unused;  // (name, file)
  for (const auto& [name, info] : by_name_) {
    if (!used_.contains(name)) unused.emplace_back(name, files_[file_of_.at(name)].path().string());
  }
  if (unused.empty()) return;
  std::sort(unused.begin(), unused.end());
  std::ostringstream msg;
  msg << "checkpoint " << dir_.string() << " has " << unused.size() << " tensor"
      << (unused.size() == 1 ? "" : "s") << " the model does not use: ";
  for (std::size_t i = 0; i < unused.size() && i < kMaxListedUnused; ++i) {
    if (i != 0) msg << ", ";
    msg << "'" << unused[i].first << "' (" << unused[i].second << ")";
  }
  if (unused.size() > kMaxListedUnused) msg << ", and " << unused.size() - kMaxListedUnused << " more";
  throw LoadError(msg.str());
}

}  // namespace capserve::runtime
