#ifndef HIMOE_MODEL_CHECKPOINT_READER_H_
#define HIMOE_MODEL_CHECKPOINT_READER_H_

// Reading checkpoints (trainer/checkpoint.h writes them and describes the
// layout): the step directories, the MANIFEST and its sha256 digests, the
// meta data (meta.textproto, a v1::RunConfig) and the pickled tensors.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/named_tensor.h"
#include "himoe/v1/model.pb.h"
#include "model/model_config.h"

namespace himoe::model {

class TransformerLM;

inline constexpr char kCheckpointManifest[] = "MANIFEST";
inline constexpr char kCheckpointFormat[] = "himoe-checkpoint-2";
inline constexpr char kCheckpointMetaFile[] = "meta.textproto";
inline constexpr char kCheckpointDenseFile[] = "dense.pt";

// "step_00000042".
std::string CheckpointDirName(int64_t step);
// "experts_g3.pt".
std::string CheckpointExpertsFile(int group);

struct CheckpointDir {
  int64_t step = 0;
  std::string path;
};

// The complete checkpoints under `root` (a directory named exactly
// step_<8+ digits> holding a MANIFEST), newest first; every other step_*
// entry goes to `incomplete` when it is not null.
absl::Status ListCheckpointDirs(const std::string& root, std::vector<CheckpointDir>* complete,
                                std::vector<std::string>* incomplete);

// The newest complete checkpoint directory under `root`; NotFound if none.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

// One line of a checkpoint's MANIFEST: "<64 lowercase hex>  <file name>".
struct ManifestEntry {
  std::string sha256;
  std::string name;
};

// The MANIFEST's entries; DataLoss (prefixed by `where`) for a malformed
// line, a bad file name (a path, ".", "..", MANIFEST) or a name twice.
absl::StatusOr<std::vector<ManifestEntry>> ParseManifest(const std::string& text,
                                                         const std::string& where);

// Lowercase hex sha256 of `data`.
absl::StatusOr<std::string> Sha256Hex(absl::string_view data);

// Reads every file the MANIFEST of checkpoint directory `dir` lists and checks
// its sha256; returns the contents by name. DataLoss naming the file for a
// missing or malformed MANIFEST, a listed file missing or failing its check,
// or a name of `required` not listed.
absl::StatusOr<std::map<std::string, std::string>> ReadVerifiedCheckpointFiles(
    const std::string& dir, const std::vector<std::string>& required);

// meta.textproto's RunConfig; DataLoss (prefixed by `where`) when it does not
// parse, has another format or a negative step.
absl::StatusOr<v1::RunConfig> ParseCheckpointMeta(const std::string& text,
                                                  const std::string& where);

// A pickled name -> tensor dict (torch::pickle_save); DataLoss otherwise.
absl::StatusOr<std::vector<NamedTensor>> UnpickleTensors(const std::string& data,
                                                         const std::string& what);

// Every parameter and buffer of `model` by name, plus each router's pending
// loss_free counts ("moe<i>_pending_counts", not registered). Live tensors.
std::vector<NamedTensor> DenseState(TransformerLM& model);

// Pairs each live dense tensor of `model` with its saved value in `saved`,
// checking that the names, shapes and dtypes match one to one.
absl::StatusOr<std::vector<std::pair<at::Tensor, at::Tensor>>> MatchDenseState(
    TransformerLM& model, const std::vector<NamedTensor>& saved, const std::string& where);

// A checkpoint as serving needs it: the meta data, the LM's options as
// trained, its dense state and each group's expert state. Every file is
// verified against the MANIFEST first. `path` is a checkpoint directory, or a
// root whose newest complete checkpoint is taken.
struct CheckpointContents {
  std::string dir;
  int64_t step = 0;
  v1::RunConfig meta;
  ModelOptions model;
  std::vector<NamedTensor> dense;
  std::vector<std::vector<NamedTensor>> experts;  // per group
};
absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& path);

// Copies `contents.dense` into `model`, built with `contents.model` (the
// names, shapes and dtypes must match). This restores the routers too.
absl::Status RestoreDenseState(const CheckpointContents& contents, TransformerLM& model);

}  // namespace himoe::model

#endif  // HIMOE_MODEL_CHECKPOINT_READER_H_
