#include "model/checkpoint_reader.h"

#include <algorithm>
#include <system_error>

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>
#include <openssl/evp.h>
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/serialize.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "model/transformer_lm.h"

namespace himoe::model {
namespace {


constexpr char kStepPrefix[] = "step_";

// step_<8 or more digits>, exactly; -1 otherwise.
int64_t ParseStepDirName(const std::string& name) {
  if (!absl::StartsWith(name, kStepPrefix)) return -1;
  const absl::string_view digits = absl::string_view(name).substr(sizeof(kStepPrefix) - 1);
  if (digits.size() < 8) return -1;
  for (const char c : digits) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return -1;
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(digits, &step)) return -1;
  return step;
}

bool IsLowerHex(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
}


// `path`'s contents; DataLoss `missing` when it does not exist.
absl::StatusOr<std::string> ReadCheckpointFile(const std::string& path,
                                               const std::string& missing) {
  absl::StatusOr<std::string> data = ReadFileToString(path);
  if (absl::IsNotFound(data.status())) return absl::DataLossError(missing);
  return data;
}

// Collects the first error of a text-format parse.
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (error_.empty()) error_ = absl::StrCat(line + 1, ":", column + 1, ": ", message);
  }
  const std::string& error() const { return error_; }

 private:
  std::string error_;
};

}  // namespace

absl::StatusOr<std::vector<ManifestEntry>> ParseManifest(const std::string& text,
                                                         const std::string& where) {
  std::vector<ManifestEntry> entries;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    // "<64 hex>  <name>"
    if (line.size() < 67 || line.substr(64, 2) != "  " || !IsLowerHex(line.substr(0, 64))) {
      return absl::DataLossError(
          absl::StrCat(where, ": malformed MANIFEST line \"", line, "\""));
    }
    ManifestEntry e{std::string(line.substr(0, 64)), std::string(line.substr(66))};
    if (e.name.find('/') != std::string::npos || e.name == "." || e.name == ".." ||
        e.name == kCheckpointManifest) {
      return absl::DataLossError(
          absl::StrCat(where, ": MANIFEST lists a bad file name \"", e.name, "\""));
    }
    for (const ManifestEntry& other : entries) {
      if (other.name == e.name) {
        return absl::DataLossError(absl::StrCat(where, ": MANIFEST lists ", e.name, " twice"));
      }
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("step_%08d", step); }

std::string CheckpointExpertsFile(int group) { return absl::StrCat("experts_g", group, ".pt"); }

absl::Status ListCheckpointDirs(const std::string& root, std::vector<CheckpointDir>* complete,
                                std::vector<std::string>* incomplete) {
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(root);
  if (!names.ok()) return absl::InternalError(names.status().message());
  for (const std::string& name : *names) {
    if (!absl::StartsWith(name, kStepPrefix)) continue;
    const int64_t step = ParseStepDirName(name);
    const std::string path = JoinPath(root, name);
    const bool is_complete = step >= 0 && IsDirectory(path) &&
                             IsRegularFile(JoinPath(path, kCheckpointManifest));
    if (is_complete) {
      complete->push_back({step, path});
    } else if (incomplete != nullptr) {
      incomplete->push_back(path);
    }
  }
  std::sort(complete->begin(), complete->end(),
            [](const CheckpointDir& a, const CheckpointDir& b) { return a.step > b.step; });
  return absl::OkStatus();
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  if (!IsDirectory(root)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint under ", root, ": not a directory"));
  }
  std::vector<CheckpointDir> complete;
  HIMOE_RETURN_IF_ERROR(ListCheckpointDirs(root, &complete, nullptr));
  if (complete.empty()) {
    return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", root));
  }
  return complete.front().path;
}

absl::StatusOr<std::string> Sha256Hex(absl::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("checkpoint: OpenSSL EVP_Digest(sha256) failed");
  }
  std::string hex;
  hex.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) absl::StrAppendFormat(&hex, "%02x", md[i]);
  return hex;
}

absl::StatusOr<std::map<std::string, std::string>> ReadVerifiedCheckpointFiles(
    const std::string& dir, const std::vector<std::string>& required) {
  const std::string where = absl::StrCat("checkpoint ", dir);
  HIMOE_ASSIGN_OR_RETURN(
      const std::string manifest,
      ReadCheckpointFile(
          JoinPath(dir, kCheckpointManifest),
          absl::StrCat(where, ": no MANIFEST (an incomplete checkpoint or not a checkpoint)")));
  HIMOE_ASSIGN_OR_RETURN(const std::vector<ManifestEntry> entries,
                         ParseManifest(manifest, where));
  for (const std::string& name : required) {
    if (std::none_of(entries.begin(), entries.end(),
                     [&](const ManifestEntry& e) { return e.name == name; })) {
      return absl::DataLossError(absl::StrCat(where, ": the MANIFEST does not list ", name));
    }
  }
  std::map<std::string, std::string> files;
  for (const ManifestEntry& e : entries) {
    HIMOE_ASSIGN_OR_RETURN(
        std::string data,
        ReadCheckpointFile(JoinPath(dir, e.name),
                           absl::StrCat(where, ": ", e.name,
                                        " is listed in the MANIFEST but missing")));
    HIMOE_ASSIGN_OR_RETURN(const std::string got, Sha256Hex(data));
    if (got != e.sha256) {
      return absl::DataLossError(absl::StrCat(where, ": ", e.name,
                                              " fails its sha256 check (expected ", e.sha256,
                                              ", got ", got, ")"));
    }
    files[e.name] = std::move(data);
  }
  return files;
}

absl::StatusOr<v1::RunConfig> ParseCheckpointMeta(const std::string& text,
                                                  const std::string& where) {
  const std::string what = absl::StrCat(where, ": ", kCheckpointMetaFile);
  v1::RunConfig meta;
  google::protobuf::TextFormat::Parser parser;
  FirstError errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &meta)) {
    return absl::DataLossError(absl::StrCat(what, ": not a RunConfig (", errors.error(), ")"));
  }
  if (meta.format() != kCheckpointFormat) {
    return absl::DataLossError(absl::StrCat(what, ": format \"", meta.format(),
                                            "\", expected ", kCheckpointFormat));
  }
  if (meta.step() < 0) {
    return absl::DataLossError(absl::StrCat(what, ": negative step ", meta.step()));
  }
  return meta;
}

absl::StatusOr<std::vector<NamedTensor>> UnpickleTensors(const std::string& data,
                                                         const std::string& what) {
  std::vector<NamedTensor> out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    const c10::IValue value = torch::pickle_load(std::vector<char>(data.begin(), data.end()));
    if (!value.isGenericDict()) {
      return absl::DataLossError(absl::StrCat(what, ": not a name -> tensor dict"));
    }
    for (const auto& entry : value.toGenericDict()) {
      if (!entry.key().isString() || !entry.value().isTensor()) {
        return absl::DataLossError(absl::StrCat(what, ": not a name -> tensor dict"));
      }
      out.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
    }
    return absl::OkStatus();
  }));
  return out;
}

std::vector<NamedTensor> DenseState(TransformerLM& model) {
  std::vector<NamedTensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value());
  }
  for (int m = 0; m < model.num_moe_layers(); ++m) {
    out.emplace_back(absl::StrCat("moe", m, "_pending_counts"), model.router(m).pending_counts());
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<at::Tensor, at::Tensor>>> MatchDenseState(
    TransformerLM& model, const std::vector<NamedTensor>& saved_dense, const std::string& where) {
  const std::vector<NamedTensor> live_dense = DenseState(model);
  std::map<std::string, at::Tensor> saved_by_name(saved_dense.begin(), saved_dense.end());
  if (saved_by_name.size() != saved_dense.size()) {
    return absl::DataLossError(absl::StrCat(where, ": dense.pt repeats a name"));
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;
  for (const auto& [name, live] : live_dense) {
    auto it = saved_by_name.find(name);
    if (it == saved_by_name.end()) {
      return absl::FailedPreconditionError(absl::StrCat(where, ": dense.pt has no tensor ", name));
    }
    if (!it->second.sizes().equals(live.sizes()) ||
        it->second.scalar_type() != live.scalar_type()) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": dense.pt's ", name, " is ", c10::toString(it->second.scalar_type()),
          c10::str(it->second.sizes()), ", the model's is ", c10::toString(live.scalar_type()),
          c10::str(live.sizes())));
    }
    pairs.emplace_back(live, it->second);
  }
  if (saved_by_name.size() != live_dense.size()) {
    for (const auto& saved : saved_by_name) {
      const std::string& name = saved.first;
      if (std::none_of(live_dense.begin(), live_dense.end(),
                       [&](const NamedTensor& l) { return l.first == name; })) {
        return absl::FailedPreconditionError(
            absl::StrCat(where, ": dense.pt has ", name, ", which the model does not"));
      }
    }
  }
  return pairs;
}

absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& path) {
  if (!IsDirectory(path)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": not a directory"));
  }
  CheckpointContents out;
  out.dir = path;
  if (KindOf(JoinPath(path, kCheckpointManifest)) == PathKind::kMissing) {
    HIMOE_ASSIGN_OR_RETURN(out.dir, LatestCheckpoint(path));
  }
  const std::string where = absl::StrCat("checkpoint ", out.dir);
  HIMOE_ASSIGN_OR_RETURN(auto files, ReadVerifiedCheckpointFiles(
                                         out.dir, {kCheckpointDenseFile, kCheckpointMetaFile}));
  HIMOE_ASSIGN_OR_RETURN(out.meta, ParseCheckpointMeta(files[kCheckpointMetaFile], where));
  out.step = out.meta.step();
  absl::StatusOr<ModelOptions> model = ModelOptionsFromProto(out.meta.model());
  if (!model.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": ", kCheckpointMetaFile, ": ",
                                            model.status().message()));
  }
  out.model = *std::move(model);
  HIMOE_ASSIGN_OR_RETURN(out.dense, UnpickleTensors(files[kCheckpointDenseFile],
                                                    absl::StrCat(where, ": dense.pt")));
  // ReadVerifiedCheckpointFiles read and checked every file the MANIFEST lists.
  for (int g = 0; g < out.model.routing.num_groups; ++g) {
    const std::string name = CheckpointExpertsFile(g);
    auto it = files.find(name);
    if (it == files.end()) {
      return absl::DataLossError(absl::StrCat(where, ": the MANIFEST does not list ", name));
    }
    HIMOE_ASSIGN_OR_RETURN(auto state,
                           UnpickleTensors(it->second, absl::StrCat(where, ": ", name)));
    out.experts.push_back(std::move(state));
  }
  return out;
}

absl::Status RestoreDenseState(const CheckpointContents& contents, TransformerLM& model) {
  HIMOE_ASSIGN_OR_RETURN(const auto pairs,
                         MatchDenseState(model, contents.dense,
                                         absl::StrCat("checkpoint ", contents.dir)));
  return CatchTorchErrors([&] {
    at::NoGradGuard no_grad;
    for (const auto& [live, saved] : pairs) live.copy_(saved);
    return absl::OkStatus();
  });
}

}  // namespace himoe::model
