#ifndef HIMOE_TRAINER_CHECKPOINT_H_
#define HIMOE_TRAINER_CHECKPOINT_H_

// Checkpoint and resume for the Trainer (model/checkpoint_reader.h reads
// checkpoints for serving).
//
// A checkpoint of step s is the directory <root>/step_<%08d s> holding
//   dense.pt         every model parameter and buffer by name, plus each
//                    router's pending loss_free counts ("moe<i>_pending_counts"),
//                    a pickled name -> tensor dict (torch::pickle_save)
//   optimizer.pt     the dense AdamW (torch::save of the optimizer)
//   experts_g<g>.pt  group g's expert weights and optimizer state, as
//                    ExpertBackend::GetState returns them (pickled dict)
//   data.txt         BatchSampler::SerializeState()
//   meta.textproto   a v1::RunConfig in text format (RunConfigFor): format
//                    "himoe-checkpoint-2", step, every model, routing and
//                    training setting
//   MANIFEST         "<sha256 hex>  <file name>" per file (sha256sum format)
//
// Crash safety: the checkpoint is built in a temporary sibling directory
// ("step_<%08d>.tmp-..."); each file is written to a temporary name, fsynced
// and renamed; MANIFEST is written last; then the directory is fsynced and
// renamed into place. Only a directory named exactly step_<8+ digits> that
// holds a MANIFEST counts as complete. One writer per root is assumed.

#include <string>

#include "absl/status/status.h"
#include "trainer/trainer.h"

namespace himoe::trainer {

// Writes the checkpoint of trainer.step() under `root` (created if needed; an
// existing checkpoint of the same step is replaced), then deletes every
// complete checkpoint but the newest `keep_last` (by step; keep_last <= 0
// keeps all) and every incomplete step_* leftover. The one just written is
// never deleted.
absl::Status SaveCheckpoint(Trainer& trainer, const std::string& root, int keep_last);

// Restores `trainer` from the checkpoint directory `dir`. Everything is read
// and verified before anything is changed: the MANIFEST (missing, malformed,
// a listed file missing or failing its sha256 -> DataLoss naming the file),
// the meta data (its ModelConfig must equal the trainer's, else
// FailedPrecondition naming each differing field with both values), the
// dense names and shapes, the dense optimizer's structure, the sampler
// state's sizes. Then it restores the sampler, the dense parameters and
// buffers, the dense optimizer, each expert group (ExpertBackend::SetState;
// remote services get the state pushed back) and the step. An error while
// applying (e.g. a service refusing the state) can leave the trainer partly
// restored.
absl::Status LoadCheckpoint(Trainer& trainer, const std::string& dir);

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_CHECKPOINT_H_
