#ifndef HIMOE_TRAINER_CHECKPOINT_H_
#define HIMOE_TRAINER_CHECKPOINT_H_

// Checkpoint and resume for the Trainer.
//
// A checkpoint of step s is the directory <root>/step_<%08d s> holding
//   dense.pt         every model parameter and buffer by name, plus each
//                    router's pending loss_free counts ("moe<i>_pending_counts"),
//                    a pickled name -> tensor dict (torch::pickle_save)
//   optimizer.pt     the dense AdamW (torch::save of the optimizer)
//   experts_g<g>.pt  group g's expert weights and optimizer state, as
//                    ExpertBackend::GetState returns them (pickled dict)
//   data.txt         BatchSampler::SerializeState()
//   meta.txt         "key value" lines: format, step, method, model sizes
//   MANIFEST         "<sha256 hex>  <file name>" per file (sha256sum format)
//
// Crash safety: the checkpoint is built in a temporary sibling directory
// ("step_<%08d>.tmp-..."); each file is written to a temporary name, fsynced
// and renamed; MANIFEST is written last; then the directory is fsynced and
// renamed into place. Only a directory named exactly step_<8+ digits> that
// holds a MANIFEST counts as complete. One writer per root is assumed.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/expert_backend.h"
#include "trainer/model.h"
#include "trainer/trainer.h"

namespace himoe::trainer {

inline constexpr char kCheckpointManifest[] = "MANIFEST";

// "step_00000042".
std::string CheckpointDirName(int64_t step);

// Writes the checkpoint of trainer.step() under `root` (created if needed; an
// existing checkpoint of the same step is replaced), then deletes every
// complete checkpoint but the newest `keep_last` (by step; keep_last <= 0
// keeps all) and every incomplete step_* leftover. The one just written is
// never deleted.
absl::Status SaveCheckpoint(Trainer& trainer, const std::string& root, int keep_last);

// The newest complete checkpoint directory under `root`; NotFound if none.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

// Restores `trainer` from the checkpoint directory `dir`. Everything is read
// and verified before anything is changed: the MANIFEST (missing, malformed,
// a listed file missing or failing its sha256 -> DataLoss naming the file),
// the meta data (method and sizes must match the trainer's), the dense names
// and shapes, the dense optimizer's structure, the sampler state's sizes.
// Then it restores the sampler, the dense parameters and buffers, the dense
// optimizer, each expert group (ExpertBackend::SetState; remote services get
// the state pushed back) and the step. An error while applying (e.g. a
// service refusing the state) can leave the trainer partly restored.
absl::Status LoadCheckpoint(Trainer& trainer, const std::string& dir);

// A checkpoint as serving needs it: the LM's options as trained (sizes,
// method, the routing hyper-parameters that act at inference, seed), its
// dense state and each group's expert state. Every file is verified against
// the MANIFEST first. `path` is a checkpoint directory, or a root whose newest
// complete checkpoint is taken.
struct CheckpointContents {
  std::string dir;
  int64_t step = 0;
  ModelOptions model;
  std::vector<NamedTensor> dense;
  std::vector<std::vector<NamedTensor>> experts;  // per group
};
absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& path);

// Copies `contents.dense` into `model`, built with `contents.model`
// (the names, shapes and dtypes must match).
absl::Status RestoreDenseState(const CheckpointContents& contents, TransformerLM& model);

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_CHECKPOINT_H_
