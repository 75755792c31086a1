#include "trainer/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <google/protobuf/text_format.h>
#include <google/protobuf/util/message_differencer.h>
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/optimizer_state_key.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "model/checkpoint_reader.h"
#include "model/model_config.h"

namespace himoe::trainer {
namespace {

using google::protobuf::util::MessageDifferencer;
using NamedTensors = std::vector<NamedTensor>;

constexpr char kOptimizerFile[] = "optimizer.pt";
constexpr char kDataFile[] = "data.txt";

using AdamWKey = std::decay_t<decltype(std::declval<torch::optim::AdamW&>().state())>::key_type;
using AdamWEntries =
    std::vector<std::pair<AdamWKey, std::unique_ptr<torch::optim::AdamWParamState>>>;

// ---- Files.

std::string Pickle(const NamedTensors& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, t] : tensors) dict.insert(name, t.detach().cpu().contiguous().clone());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  return std::string(bytes.begin(), bytes.end());
}

// The dense AdamW state by parameter name: "<name>.exp_avg",
// "<name>.exp_avg_sq" and "<name>.step" (an int64 scalar) for each parameter
// with state, in the model's order. (torch::save(optimizer) files the state
// under the parameters' addresses: equal states would give other bytes in
// every process.)
NamedTensors DenseOptimizerState(Trainer& trainer) {
  NamedTensors out;
  const auto& states = trainer.optimizer().state();
  for (const auto& item : trainer.model().named_parameters()) {
    const auto it = states.find(OptimizerStateKey<AdamWKey>(item.value().unsafeGetTensorImpl()));
    if (it == states.end()) continue;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.emplace_back(item.key() + ".exp_avg", s.exp_avg());
    out.emplace_back(item.key() + ".exp_avg_sq", s.exp_avg_sq());
    out.emplace_back(item.key() + ".step", at::scalar_tensor(s.step(), at::kLong));
  }
  return out;
}

// DenseOptimizerState's tensors checked against the model (every name a
// parameter's field, shapes equal, the three fields together) and built into
// state entries, not applied yet.
absl::StatusOr<AdamWEntries> MatchOptimizerState(Trainer& trainer, const NamedTensors& saved,
                                                 const std::string& where) {
  std::map<std::string, at::Tensor> params;
  for (const auto& item : trainer.model().named_parameters()) params[item.key()] = item.value();
  std::map<std::string, std::map<std::string, at::Tensor>> fields;
  for (const auto& [name, t] : saved) {
    std::string param, field;
    if (!SplitAdamWStateName(name, &param, &field) || params.count(param) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": optimizer.pt: '", name,
          "' is not <parameter>.<exp_avg|exp_avg_sq|step> of a parameter of this model"));
    }
    const bool step = field == "step";
    if (step ? (t.dim() != 0 || t.scalar_type() != at::kLong)
             : !t.sizes().equals(params[param].sizes())) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": optimizer.pt: '", name, "' has shape ", c10::str(t.sizes()), " ",
                       c10::toString(t.scalar_type()), "; expected ",
                       step ? "an int64 scalar" : c10::str(params[param].sizes())));
    }
    fields[param][field] = t;
  }
  AdamWEntries out;
  for (auto& [param, f] : fields) {
    for (const char* name : kAdamWStateFields) {
      if (f.count(name) == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat(where, ": optimizer.pt: '", param, "' lacks ", name,
                         "; exp_avg, exp_avg_sq and step go together"));
      }
    }
    const at::Tensor& p = params[param];
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(f["step"].item<int64_t>());
    state->exp_avg(f["exp_avg"].to(p.device(), p.scalar_type()).clone());
    state->exp_avg_sq(f["exp_avg_sq"].to(p.device(), p.scalar_type()).clone());
    out.emplace_back(OptimizerStateKey<AdamWKey>(p.unsafeGetTensorImpl()), std::move(state));
  }
  return out;
}

// ---- Saving.

// Writes the files of one checkpoint into its (temporary) directory, each
// durably, and records their digests for the MANIFEST.
class CheckpointFileWriter {
 public:
  explicit CheckpointFileWriter(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Write(const std::string& name, const std::string& data) {
    HIMOE_RETURN_IF_ERROR(WriteFileAtomically(JoinPath(dir_, name), data, /*durable=*/true));
    HIMOE_ASSIGN_OR_RETURN(const std::string sha, model::Sha256Hex(data));
    absl::StrAppend(&manifest_, sha, "  ", name, "\n");
    return absl::OkStatus();
  }

  // Last: the MANIFEST's presence marks the checkpoint complete.
  absl::Status Finish() {
    return WriteFileAtomically(JoinPath(dir_, model::kCheckpointManifest), manifest_,
                               /*durable=*/true);
  }

 private:
  std::string dir_;
  std::string manifest_;
};

absl::Status WriteCheckpointFiles(Trainer& trainer, CheckpointFileWriter& out) {
  std::string dense, optimizer;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    at::NoGradGuard no_grad;
    dense = Pickle(model::DenseState(trainer.model()));
    optimizer = Pickle(DenseOptimizerState(trainer));
    return absl::OkStatus();
  }));
  HIMOE_RETURN_IF_ERROR(out.Write(model::kCheckpointDenseFile, dense));
  HIMOE_RETURN_IF_ERROR(out.Write(kOptimizerFile, optimizer));
  for (int g = 0; g < trainer.experts().num_groups(); ++g) {
    HIMOE_ASSIGN_OR_RETURN(const NamedTensors state, trainer.experts().GetState(g));
    std::string bytes;
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      bytes = Pickle(state);
      return absl::OkStatus();
    }));
    HIMOE_RETURN_IF_ERROR(out.Write(model::CheckpointExpertsFile(g), bytes));
  }
  HIMOE_RETURN_IF_ERROR(out.Write(kDataFile, trainer.sampler().SerializeState()));
  std::string meta;
  if (!google::protobuf::TextFormat::PrintToString(
          RunConfigFor(trainer.options(), trainer.step()), &meta)) {
    return absl::InternalError("cannot print the checkpoint's meta data");
  }
  HIMOE_RETURN_IF_ERROR(out.Write(model::kCheckpointMetaFile, meta));
  return out.Finish();
}

// Renames `tmp` to `final_path`; an existing checkpoint of this step is moved
// aside first (rename cannot replace a non-empty directory).
absl::Status MoveIntoPlace(const std::string& root, const std::string& tmp,
                           const std::string& final_path) {
  if (KindOf(final_path) != PathKind::kMissing) {
    const std::string old_path = JoinPath(
        root, absl::StrCat(Basename(final_path), ".old-", static_cast<int64_t>(::getpid())));
    HIMOE_RETURN_IF_ERROR(RemoveAll(old_path));
    HIMOE_RETURN_IF_ERROR(RenamePath(final_path, old_path));
    HIMOE_RETURN_IF_ERROR(RenamePath(tmp, final_path));
    HIMOE_RETURN_IF_ERROR(RemoveAll(old_path));
  } else {
    HIMOE_RETURN_IF_ERROR(RenamePath(tmp, final_path));
  }
  return FsyncDir(root);
}

// Deletes every incomplete step_* entry and every complete checkpoint but
// the newest `keep_last` (never `keep`).
absl::Status ApplyRetention(const std::string& root, const std::string& keep, int keep_last) {
  std::vector<model::CheckpointDir> complete;
  std::vector<std::string> incomplete;
  HIMOE_RETURN_IF_ERROR(model::ListCheckpointDirs(root, &complete, &incomplete));
  for (const std::string& p : incomplete) HIMOE_RETURN_IF_ERROR(RemoveAll(p));
  if (keep_last > 0) {
    for (size_t i = static_cast<size_t>(keep_last); i < complete.size(); ++i) {
      if (complete[i].path == keep) continue;
      HIMOE_RETURN_IF_ERROR(RemoveAll(complete[i].path));
    }
  }
  return absl::OkStatus();
}

// ---- Loading.

// Collects "path: <checkpoint's> in the checkpoint, <run's> in this run" per
// differing field.
class DifferenceList : public MessageDifferencer::Reporter {
 public:
  void ReportModified(const google::protobuf::Message& checkpoint,
                      const google::protobuf::Message& run,
                      const std::vector<MessageDifferencer::SpecificField>& path) override {
    const google::protobuf::FieldDescriptor* field = path.back().field;
    if (field == nullptr ||
        field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      return;  // the leaves are reported on their own
    }
    std::string name = "model";
    for (const auto& f : path) absl::StrAppend(&name, ".", f.field->name());
    differences_.push_back(absl::StrCat(name, ": ", Value(checkpoint, field),
                                        " in the checkpoint, ", Value(run, field),
                                        " in this run"));
  }
  void ReportAdded(const google::protobuf::Message&, const google::protobuf::Message&,
                   const std::vector<MessageDifferencer::SpecificField>&) override {}
  void ReportDeleted(const google::protobuf::Message&, const google::protobuf::Message&,
                     const std::vector<MessageDifferencer::SpecificField>&) override {}

  const std::vector<std::string>& differences() const { return differences_; }

 private:
  static std::string Value(const google::protobuf::Message& message,
                           const google::protobuf::FieldDescriptor* field) {
    std::string out;
    google::protobuf::TextFormat::Printer().PrintFieldValueToString(message, field, -1, &out);
    return out;
  }

  std::vector<std::string> differences_;
};

// OK when the checkpoint's model is this run's; else FailedPrecondition
// naming every differing field with both values.
absl::Status CheckSameModel(const v1::ModelConfig& checkpoint, const v1::ModelConfig& run,
                            const std::string& where) {
  MessageDifferencer differencer;
  // Unset and default are the same value: every field is compared.
  differencer.set_message_field_comparison(MessageDifferencer::EQUIVALENT);
  DifferenceList differences;
  differencer.ReportDifferencesTo(&differences);
  if (differencer.Compare(checkpoint, run)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(where, ": it was saved from another model: ",
                   absl::StrJoin(differences.differences(), "; ")));
}

// A scratch AdamW over the same parameters (optimizer.pt as torch::save
// wrote it, in checkpoints of earlier versions) with the same group structure,
// loaded from `data`: proves torch::load will succeed on the real one and
// checks the state shapes, without touching the real optimizer.
absl::Status ValidateOptimizerState(torch::optim::AdamW& real, const std::string& data,
                                    const std::string& where) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (auto& g : real.param_groups()) {
    groups.emplace_back(g.params(), g.options().clone());
  }
  torch::optim::AdamW scratch(std::move(groups),
                              static_cast<const torch::optim::AdamWOptions&>(real.defaults()));
  const absl::Status loaded = CatchTorchErrors([&] {
    std::istringstream in(data);
    torch::load(scratch, in);
    return absl::OkStatus();
  });
  if (!loaded.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": optimizer.pt does not fit this model's optimizer: ",
                     loaded.message()));
  }
  using Key = std::decay_t<decltype(scratch.state())>::key_type;
  for (auto& g : scratch.param_groups()) {
    for (const at::Tensor& p : g.params()) {
      auto it = scratch.state().find(OptimizerStateKey<Key>(p.unsafeGetTensorImpl()));
      if (it == scratch.state().end()) continue;
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      for (const at::Tensor& t : {s.exp_avg(), s.exp_avg_sq()}) {
        if (!t.defined() || !t.sizes().equals(p.sizes())) {
          return absl::FailedPreconditionError(absl::StrCat(
              where, ": optimizer.pt holds AdamW state of the wrong shape for a parameter of "
                     "shape ",
              c10::str(p.sizes())));
        }
      }
    }
  }
  return absl::OkStatus();
}

// A checkpoint read and validated against a trainer, not applied yet.
struct ValidatedCheckpoint {
  int64_t step = 0;
  std::map<std::string, std::string> files;
  std::vector<std::pair<at::Tensor, at::Tensor>> dense;  // (live, saved)
  // Empty with `legacy_optimizer`: optimizer.pt is torch::save's.
  AdamWEntries optimizer;
  bool legacy_optimizer = false;
  std::vector<NamedTensors> experts;
};

absl::StatusOr<ValidatedCheckpoint> ReadAndValidate(Trainer& trainer, const std::string& dir,
                                                    const std::string& where) {
  const int num_groups = trainer.experts().num_groups();
  std::vector<std::string> required = {model::kCheckpointDenseFile, kOptimizerFile, kDataFile,
                                       model::kCheckpointMetaFile};
  for (int g = 0; g < num_groups; ++g) required.push_back(model::CheckpointExpertsFile(g));
  ValidatedCheckpoint out;
  HIMOE_ASSIGN_OR_RETURN(out.files, model::ReadVerifiedCheckpointFiles(dir, required));
  HIMOE_ASSIGN_OR_RETURN(const v1::RunConfig meta,
                         model::ParseCheckpointMeta(out.files[model::kCheckpointMetaFile], where));
  out.step = meta.step();
  HIMOE_RETURN_IF_ERROR(
      CheckSameModel(meta.model(), model::ModelConfigToProto(trainer.options().model), where));
  HIMOE_ASSIGN_OR_RETURN(const NamedTensors saved_dense,
                         model::UnpickleTensors(out.files[model::kCheckpointDenseFile],
                                                absl::StrCat(where, ": dense.pt")));
  HIMOE_ASSIGN_OR_RETURN(out.dense, model::MatchDenseState(trainer.model(), saved_dense, where));
  const absl::StatusOr<NamedTensors> saved_optimizer =
      model::UnpickleTensors(out.files[kOptimizerFile], absl::StrCat(where, ": optimizer.pt"));
  if (saved_optimizer.ok()) {
    absl::StatusOr<AdamWEntries> matched;
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      matched = MatchOptimizerState(trainer, *saved_optimizer, where);
      return matched.status();
    }));
    out.optimizer = std::move(matched).value();
  } else {
    out.legacy_optimizer = true;
    HIMOE_RETURN_IF_ERROR(
        ValidateOptimizerState(trainer.optimizer(), out.files[kOptimizerFile], where));
  }
  for (int g = 0; g < num_groups; ++g) {
    const std::string name = model::CheckpointExpertsFile(g);
    HIMOE_ASSIGN_OR_RETURN(
        NamedTensors state,
        model::UnpickleTensors(out.files[name], absl::StrCat(where, ": ", name)));
    out.experts.push_back(std::move(state));
  }
  return out;
}

// The sampler first (it validates and is all-or-nothing; rolled back if the
// experts fail), then the experts (a service may refuse), then what was fully
// validated before.
absl::Status Apply(Trainer& trainer, ValidatedCheckpoint& c, const std::string& where) {
  const std::string old_sampler = trainer.sampler().SerializeState();
  if (absl::Status s = trainer.sampler().RestoreState(c.files[kDataFile]); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(where, ": data.txt: ", s.message()));
  }
  // Groups that ranks share are restored by rank 0.
  const int restored = trainer.restores_experts() ? static_cast<int>(c.experts.size()) : 0;
  for (int g = 0; g < restored; ++g) {
    const absl::Status s = trainer.experts().SetState(g, c.experts[g]);
    if (!s.ok()) {
      trainer.sampler().RestoreState(old_sampler).IgnoreError();
      return absl::Status(s.code(), absl::StrCat(where, ": restoring expert group ", g,
                                                 (g > 0 ? " (earlier groups were restored)" : ""),
                                                 ": ", s.message()));
    }
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    at::NoGradGuard no_grad;
    for (const auto& [live, saved] : c.dense) live.copy_(saved);
    if (c.legacy_optimizer) {
      std::istringstream in(c.files[kOptimizerFile]);
      torch::load(trainer.optimizer(), in);
      return absl::OkStatus();
    }
    auto& states = trainer.optimizer().state();
    states.clear();
    for (auto& [key, state] : c.optimizer) states[key] = std::move(state);
    return absl::OkStatus();
  }));
  trainer.set_step(c.step);
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveCheckpoint(Trainer& trainer, const std::string& root, int keep_last) {
  const std::string final_name = model::CheckpointDirName(trainer.step());
  const std::string final_path = JoinPath(root, final_name);
  const std::string tmp_path =
      JoinPath(root, absl::StrCat(final_name, ".tmp-", static_cast<int64_t>(::getpid())));
  HIMOE_RETURN_IF_ERROR(CreateDirectories(root));
  HIMOE_RETURN_IF_ERROR(RemoveAll(tmp_path));
  if (::mkdir(tmp_path.c_str(), 0755) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("mkdir ", tmp_path));
  }
  const absl::Status written = [&]() -> absl::Status {
    CheckpointFileWriter writer(tmp_path);
    HIMOE_RETURN_IF_ERROR(WriteCheckpointFiles(trainer, writer));
    HIMOE_RETURN_IF_ERROR(FsyncDir(tmp_path));
    return MoveIntoPlace(root, tmp_path, final_path);
  }();
  if (!written.ok()) {
    RemoveAll(tmp_path).IgnoreError();
    return absl::Status(written.code(), absl::StrCat("saving checkpoint ", final_path,
                                                     ": ", written.message()));
  }
  return ApplyRetention(root, final_path, keep_last);
}

absl::Status LoadCheckpoint(Trainer& trainer, const std::string& dir) {
  const std::string where = absl::StrCat("checkpoint ", dir);
  if (!IsDirectory(dir)) {
    return absl::NotFoundError(absl::StrCat(where, ": not a directory"));
  }
  HIMOE_ASSIGN_OR_RETURN(ValidatedCheckpoint checkpoint, ReadAndValidate(trainer, dir, where));
  return Apply(trainer, checkpoint, where);
}

}  // namespace himoe::trainer
