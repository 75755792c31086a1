#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <openssl/evp.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "router_service/routing_config.h"

namespace himoe::trainer {
namespace {

namespace fs = std::filesystem;

constexpr char kFormat[] = "himoe-checkpoint-1";
constexpr char kDenseFile[] = "dense.pt";
constexpr char kOptimizerFile[] = "optimizer.pt";
constexpr char kDataFile[] = "data.txt";
constexpr char kMetaFile[] = "meta.txt";
constexpr char kStepPrefix[] = "step_";

std::string ExpertsFile(int group) { return absl::StrCat("experts_g", group, ".pt"); }

// ---- Files.

absl::Status ErrnoError(const std::string& what) {
  return absl::ErrnoToStatus(errno, what);
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

absl::Status FsyncPath(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", path.string()));
  const int rc = ::fsync(fd);
  const int fsync_errno = errno;
  ::close(fd);
  if (rc != 0) {
    errno = fsync_errno;
    return ErrnoError(absl::StrCat("fsync ", path.string()));
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const fs::path& dir) { return FsyncPath(dir, O_RDONLY | O_DIRECTORY); }

absl::Status Rename(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoError(absl::StrCat("rename ", from.string(), " -> ", to.string()));
  }
  return absl::OkStatus();
}

// Writes `dir/name` through "dir/name.tmp": write, fsync, rename.
absl::Status WriteFileAtomically(const fs::path& dir, const std::string& name,
                                 absl::string_view data) {
  const fs::path tmp = dir / (name + ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", tmp.string()));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status s = ErrnoError(absl::StrCat("write ", tmp.string()));
      ::close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const absl::Status s = ErrnoError(absl::StrCat("fsync ", tmp.string()));
    ::close(fd);
    return s;
  }
  if (::close(fd) != 0) return ErrnoError(absl::StrCat("close ", tmp.string()));
  return Rename(tmp, dir / name);
}

// NotFound when missing.
absl::StatusOr<std::string> ReadFile(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", path.string()));
  std::string data;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status s = ErrnoError(absl::StrCat("read ", path.string()));
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return data;
}

// ---- Step directories.

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

struct StepDir {
  int64_t step;
  fs::path path;
};

// Complete checkpoints (sorted by step, newest first) and every other
// step_* entry (temporaries, directories without a MANIFEST).
absl::Status ListStepDirs(const fs::path& root, std::vector<StepDir>* complete,
                          std::vector<fs::path>* incomplete) {
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!absl::StartsWith(name, kStepPrefix)) continue;
    const int64_t step = ParseStepDirName(name);
    std::error_code ec2;
    const bool is_complete = step >= 0 && fs::is_directory(it->path(), ec2) &&
                             fs::is_regular_file(it->path() / kCheckpointManifest, ec2);
    if (is_complete) {
      complete->push_back({step, it->path()});
    } else if (incomplete != nullptr) {
      incomplete->push_back(it->path());
    }
  }
  if (ec) return absl::InternalError(absl::StrCat("list ", root.string(), ": ", ec.message()));
  std::sort(complete->begin(), complete->end(),
            [](const StepDir& a, const StepDir& b) { return a.step > b.step; });
  return absl::OkStatus();
}

absl::Status RemoveAll(const fs::path& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return absl::InternalError(absl::StrCat("remove ", path.string(), ": ", ec.message()));
  return absl::OkStatus();
}

// ---- Serialization.

using NamedTensors = std::vector<NamedTensor>;

std::string Pickle(const NamedTensors& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, t] : tensors) dict.insert(name, t.detach().cpu().contiguous().clone());
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  return std::string(bytes.begin(), bytes.end());
}

absl::StatusOr<NamedTensors> Unpickle(const std::string& data, const std::string& what) {
  NamedTensors out;
  RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
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

// Every parameter and buffer of the model by name, plus the routers' pending
// loss_free counts (not registered buffers). Live tensors, not copies.
NamedTensors DenseState(TransformerLM& model) {
  NamedTensors out;
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

// Pairs each live dense tensor of `model` with its saved value, checking that
// the names, shapes and dtypes match one to one.
absl::StatusOr<std::vector<std::pair<at::Tensor, at::Tensor>>> MatchDenseState(
    TransformerLM& model, const NamedTensors& saved_dense, const std::string& where) {
  const NamedTensors live_dense = DenseState(model);
  std::map<std::string, at::Tensor> saved_by_name(saved_dense.begin(), saved_dense.end());
  if (saved_by_name.size() != saved_dense.size()) {
    return absl::DataLossError(absl::StrCat(where, ": dense.pt repeats a name"));
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;
  for (const auto& [name, live] : live_dense) {
    auto it = saved_by_name.find(name);
    if (it == saved_by_name.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": dense.pt has no tensor ", name));
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
    for (const auto& [name, t] : saved_by_name) {
      if (std::none_of(live_dense.begin(), live_dense.end(),
                       [&](const NamedTensor& l) { return l.first == name; })) {
        return absl::FailedPreconditionError(
            absl::StrCat(where, ": dense.pt has ", name, ", which the model does not"));
      }
    }
  }
  return pairs;
}

// ---- meta.txt.

std::map<std::string, std::string> MetaFields(const Trainer& trainer) {
  const TrainerOptions& o = trainer.options();
  const ModelOptions& m = o.model;
  std::map<std::string, std::string> f;
  f["method"] = std::string(router::RoutingMethodName(m.routing.method));
  f["vocab_size"] = absl::StrCat(m.vocab_size);
  f["block_size"] = absl::StrCat(m.block_size);
  f["n_layer"] = absl::StrCat(m.n_layer);
  f["n_head"] = absl::StrCat(m.n_head);
  f["d_model"] = absl::StrCat(m.d_model);
  f["d_ff"] = absl::StrCat(m.d_ff);
  f["dense_ff"] = absl::StrCat(m.dense_ff);
  f["moe_every"] = absl::StrCat(m.moe_every);
  f["num_experts"] = absl::StrCat(m.routing.num_experts);
  f["num_groups"] = absl::StrCat(m.routing.num_groups);
  f["top_k"] = absl::StrCat(m.routing.top_k);
  return f;
}

// Keys that must match the trainer a checkpoint is loaded into.
constexpr const char* kMatchedMetaKeys[] = {
    "method", "vocab_size", "block_size", "n_layer",     "n_head",      "d_model",
    "d_ff",   "dense_ff",   "moe_every",  "num_experts", "num_groups",  "top_k"};

std::string MetaText(const Trainer& trainer) {
  const TrainerOptions& o = trainer.options();
  const ModelOptions& m = o.model;
  const std::map<std::string, std::string> f = MetaFields(trainer);
  std::string text = absl::StrCat("format ", kFormat, "\n", "step ", trainer.step(), "\n");
  for (const char* key : kMatchedMetaKeys) absl::StrAppend(&text, key, " ", f.at(key), "\n");
  absl::StrAppend(&text, "batch_size ", o.batch_size, "\n", "grad_accum ", o.grad_accum, "\n",
                  "remote_experts ", o.remote_experts ? 1 : 0, "\n");
  const router::RoutingConfig& r = m.routing;
  absl::StrAppend(&text, "seed ", m.seed, "\n", "routing_temperature ", r.temperature, "\n",
                  "routing_tau ", r.tau, "\n", "routing_ema_beta ", r.ema_beta, "\n",
                  "routing_capacity_factor ", r.capacity_factor, "\n",
                  "routing_renormalize ", r.renormalize ? 1 : 0, "\n");
  absl::StrAppend(&text, "description ", f.at("method"), " MoE LM at step ", trainer.step(),
                  ": ", m.n_layer, " layers, d_model ", m.d_model, ", ", m.n_head, " heads, N=",
                  m.routing.num_experts, " experts in M=", m.routing.num_groups,
                  " groups (top_k ", m.routing.top_k, "), d_ff ", m.d_ff, ", vocab ",
                  m.vocab_size, ", block ", m.block_size, "\n");
  return text;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMeta(const std::string& text,
                                                             const std::string& what) {
  std::map<std::string, std::string> f;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const size_t space = line.find(' ');
    if (space == absl::string_view::npos || space == 0) {
      return absl::DataLossError(absl::StrCat(what, ": malformed line \"", line, "\""));
    }
    f[std::string(line.substr(0, space))] = std::string(line.substr(space + 1));
  }
  if (f["format"] != kFormat) {
    return absl::DataLossError(
        absl::StrCat(what, ": format \"", f["format"], "\", expected ", kFormat));
  }
  return f;
}

// ---- MANIFEST.

struct ManifestEntry {
  std::string sha256;
  std::string name;
};

bool IsLowerHex(absl::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  });
}

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
        return absl::DataLossError(
            absl::StrCat(where, ": MANIFEST lists ", e.name, " twice"));
      }
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

// Reads every file the MANIFEST lists and checks its sha256; returns the
// contents by name. Also requires each of `required` to be listed.
absl::StatusOr<std::map<std::string, std::string>> ReadVerified(
    const fs::path& dir, const std::vector<std::string>& required) {
  const std::string where = absl::StrCat("checkpoint ", dir.string());
  absl::StatusOr<std::string> manifest = ReadFile(dir / kCheckpointManifest);
  if (!manifest.ok()) {
    if (absl::IsNotFound(manifest.status())) {
      return absl::DataLossError(
          absl::StrCat(where, ": no MANIFEST (an incomplete checkpoint or not a checkpoint)"));
    }
    return manifest.status();
  }
  ASSIGN_OR_RETURN(const std::vector<ManifestEntry> entries, ParseManifest(*manifest, where));
  for (const std::string& name : required) {
    if (std::none_of(entries.begin(), entries.end(),
                     [&](const ManifestEntry& e) { return e.name == name; })) {
      return absl::DataLossError(absl::StrCat(where, ": the MANIFEST does not list ", name));
    }
  }
  std::map<std::string, std::string> files;
  for (const ManifestEntry& e : entries) {
    absl::StatusOr<std::string> data = ReadFile(dir / e.name);
    if (!data.ok()) {
      if (absl::IsNotFound(data.status())) {
        return absl::DataLossError(
            absl::StrCat(where, ": ", e.name, " is listed in the MANIFEST but missing"));
      }
      return data.status();
    }
    ASSIGN_OR_RETURN(const std::string got, Sha256Hex(*data));
    if (got != e.sha256) {
      return absl::DataLossError(absl::StrCat(where, ": ", e.name,
                                              " fails its sha256 check (expected ", e.sha256,
                                              ", got ", got, ")"));
    }
    files[e.name] = std::move(*data);
  }
  return files;
}

// ---- Dense optimizer.

// A scratch AdamW over the same parameters with the same group structure,
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
  for (auto& g : scratch.param_groups()) {
    for (const at::Tensor& p : g.params()) {
      auto it = scratch.state().find(c10::guts::to_string(p.unsafeGetTensorImpl()));
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

}  // namespace

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("step_%08d", step); }

absl::Status SaveCheckpoint(Trainer& trainer, const std::string& root, int keep_last) {
  const fs::path root_path(root);
  const int64_t step = trainer.step();
  const std::string final_name = CheckpointDirName(step);
  const fs::path final_path = root_path / final_name;
  const fs::path tmp_path =
      root_path / absl::StrCat(final_name, ".tmp-", static_cast<int64_t>(::getpid()));
  {
    std::error_code ec;
    fs::create_directories(root_path, ec);
    if (ec) return absl::InternalError(absl::StrCat("mkdir ", root, ": ", ec.message()));
  }
  RETURN_IF_ERROR(RemoveAll(tmp_path));
  if (::mkdir(tmp_path.c_str(), 0755) != 0) {
    return ErrnoError(absl::StrCat("mkdir ", tmp_path.string()));
  }

  std::string manifest;
  const auto write = [&](const std::string& name, const std::string& data) -> absl::Status {
    RETURN_IF_ERROR(WriteFileAtomically(tmp_path, name, data));
    ASSIGN_OR_RETURN(const std::string sha, Sha256Hex(data));
    absl::StrAppend(&manifest, sha, "  ", name, "\n");
    return absl::OkStatus();
  };
  const absl::Status written = [&]() -> absl::Status {
    std::string dense, optimizer;
    RETURN_IF_ERROR(CatchTorchErrors([&] {
      torch::NoGradGuard no_grad;
      dense = Pickle(DenseState(trainer.model()));
      std::ostringstream out;
      torch::save(trainer.optimizer(), out);
      optimizer = out.str();
      return absl::OkStatus();
    }));
    RETURN_IF_ERROR(write(kDenseFile, dense));
    RETURN_IF_ERROR(write(kOptimizerFile, optimizer));
    for (int g = 0; g < trainer.experts().num_groups(); ++g) {
      ASSIGN_OR_RETURN(const NamedTensors state, trainer.experts().GetState(g));
      std::string bytes;
      RETURN_IF_ERROR(CatchTorchErrors([&] {
        bytes = Pickle(state);
        return absl::OkStatus();
      }));
      RETURN_IF_ERROR(write(ExpertsFile(g), bytes));
    }
    RETURN_IF_ERROR(write(kDataFile, trainer.sampler().SerializeState()));
    RETURN_IF_ERROR(write(kMetaFile, MetaText(trainer)));
    // Last: its presence marks the checkpoint complete.
    RETURN_IF_ERROR(WriteFileAtomically(tmp_path, kCheckpointManifest, manifest));
    RETURN_IF_ERROR(FsyncDir(tmp_path));
    // Into place; an existing checkpoint of this step is moved aside first
    // (rename cannot replace a non-empty directory).
    std::error_code ec;
    if (fs::exists(final_path, ec)) {
      const fs::path old_path =
          root_path / absl::StrCat(final_name, ".old-", static_cast<int64_t>(::getpid()));
      RETURN_IF_ERROR(RemoveAll(old_path));
      RETURN_IF_ERROR(Rename(final_path, old_path));
      RETURN_IF_ERROR(Rename(tmp_path, final_path));
      RETURN_IF_ERROR(RemoveAll(old_path));
    } else {
      RETURN_IF_ERROR(Rename(tmp_path, final_path));
    }
    return FsyncDir(root_path);
  }();
  if (!written.ok()) {
    RemoveAll(tmp_path).IgnoreError();
    return absl::Status(written.code(),
                        absl::StrCat("saving checkpoint ", final_path.string(), ": ",
                                     written.message()));
  }

  // Retention.
  std::vector<StepDir> complete;
  std::vector<fs::path> incomplete;
  RETURN_IF_ERROR(ListStepDirs(root_path, &complete, &incomplete));
  for (const fs::path& p : incomplete) RETURN_IF_ERROR(RemoveAll(p));
  if (keep_last > 0) {
    for (size_t i = static_cast<size_t>(keep_last); i < complete.size(); ++i) {
      if (complete[i].path == final_path) continue;
      RETURN_IF_ERROR(RemoveAll(complete[i].path));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint under ", root, ": not a directory"));
  }
  std::vector<StepDir> complete;
  RETURN_IF_ERROR(ListStepDirs(root, &complete, nullptr));
  if (complete.empty()) {
    return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", root));
  }
  return complete.front().path.string();
}

absl::Status LoadCheckpoint(Trainer& trainer, const std::string& dir) {
  const fs::path dir_path(dir);
  const std::string where = absl::StrCat("checkpoint ", dir);
  {
    std::error_code ec;
    if (!fs::is_directory(dir_path, ec)) {
      return absl::NotFoundError(absl::StrCat(where, ": not a directory"));
    }
  }
  const int num_groups = trainer.experts().num_groups();
  std::vector<std::string> required = {kDenseFile, kOptimizerFile, kDataFile, kMetaFile};
  for (int g = 0; g < num_groups; ++g) required.push_back(ExpertsFile(g));

  // 1. Read everything and check the sha256 of every file.
  ASSIGN_OR_RETURN(auto files, ReadVerified(dir_path, required));

  // 2. Validate before changing anything.
  ASSIGN_OR_RETURN(auto meta,
                   ParseMeta(files[kMetaFile], absl::StrCat(where, ": meta.txt")));
  int64_t step = 0;
  if (!absl::SimpleAtoi(meta["step"], &step) || step < 0) {
    return absl::DataLossError(
        absl::StrCat(where, ": meta.txt has no valid step (\"", meta["step"], "\")"));
  }
  const std::map<std::string, std::string> mine = MetaFields(trainer);
  for (const char* key : kMatchedMetaKeys) {
    if (meta[key] != mine.at(key)) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, ": it was saved with ", key, " ", meta[key],
                       ", this trainer has ", mine.at(key)));
    }
  }

  ASSIGN_OR_RETURN(const NamedTensors saved_dense,
                   Unpickle(files[kDenseFile], absl::StrCat(where, ": dense.pt")));
  ASSIGN_OR_RETURN(const auto dense_pairs,
                   MatchDenseState(trainer.model(), saved_dense, where));

  RETURN_IF_ERROR(ValidateOptimizerState(trainer.optimizer(), files[kOptimizerFile], where));

  std::vector<NamedTensors> experts(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    ASSIGN_OR_RETURN(experts[g],
                     Unpickle(files[ExpertsFile(g)], absl::StrCat(where, ": ", ExpertsFile(g))));
  }

  // 3. Apply. The sampler first (it validates and is all-or-nothing; rolled
  // back if the experts fail), then the experts (a service may refuse), then
  // what was fully validated above.
  const std::string old_sampler = trainer.sampler().SerializeState();
  {
    const absl::Status s = trainer.sampler().RestoreState(files[kDataFile]);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(where, ": data.txt: ", s.message()));
  }
  for (int g = 0; g < num_groups; ++g) {
    const absl::Status s = trainer.experts().SetState(g, experts[g]);
    if (!s.ok()) {
      trainer.sampler().RestoreState(old_sampler).IgnoreError();
      return absl::Status(s.code(), absl::StrCat(where, ": restoring expert group ", g,
                                                 (g > 0 ? " (earlier groups were restored)" : ""),
                                                 ": ", s.message()));
    }
  }
  RETURN_IF_ERROR(CatchTorchErrors([&] {
    torch::NoGradGuard no_grad;
    for (const auto& [live, saved] : dense_pairs) live.copy_(saved);
    std::istringstream in(files[kOptimizerFile]);
    torch::load(trainer.optimizer(), in);
    return absl::OkStatus();
  }));
  trainer.set_step(step);
  return absl::OkStatus();
}

absl::StatusOr<CheckpointContents> ReadCheckpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": not a directory"));
  }
  CheckpointContents out;
  out.dir = path;
  if (!fs::exists(fs::path(path) / kCheckpointManifest, ec)) {
    ASSIGN_OR_RETURN(out.dir, LatestCheckpoint(path));
  }
  const std::string where = absl::StrCat("checkpoint ", out.dir);
  ASSIGN_OR_RETURN(auto files, ReadVerified(out.dir, {kDenseFile, kMetaFile}));
  ASSIGN_OR_RETURN(auto meta, ParseMeta(files[kMetaFile], absl::StrCat(where, ": meta.txt")));
  const auto field = [&](const char* key, auto* value) -> absl::Status {
    bool ok = false;
    if constexpr (std::is_same_v<std::remove_pointer_t<decltype(value)>, double>) {
      ok = absl::SimpleAtod(meta[key], value);
    } else {
      ok = absl::SimpleAtoi(meta[key], value);
    }
    if (!ok) {
      return absl::DataLossError(
          absl::StrCat(where, ": meta.txt: ", key, " is \"", meta[key], "\", not a number"));
    }
    return absl::OkStatus();
  };
  ModelOptions& m = out.model;
  router::RoutingConfig& r = m.routing;
  RETURN_IF_ERROR(field("step", &out.step));
  RETURN_IF_ERROR(field("vocab_size", &m.vocab_size));
  RETURN_IF_ERROR(field("block_size", &m.block_size));
  RETURN_IF_ERROR(field("n_layer", &m.n_layer));
  RETURN_IF_ERROR(field("n_head", &m.n_head));
  RETURN_IF_ERROR(field("d_model", &m.d_model));
  RETURN_IF_ERROR(field("d_ff", &m.d_ff));
  RETURN_IF_ERROR(field("dense_ff", &m.dense_ff));
  RETURN_IF_ERROR(field("moe_every", &m.moe_every));
  RETURN_IF_ERROR(field("num_experts", &r.num_experts));
  RETURN_IF_ERROR(field("num_groups", &r.num_groups));
  RETURN_IF_ERROR(field("top_k", &r.top_k));
  RETURN_IF_ERROR(field("seed", &m.seed));
  RETURN_IF_ERROR(field("routing_temperature", &r.temperature));
  RETURN_IF_ERROR(field("routing_tau", &r.tau));
  RETURN_IF_ERROR(field("routing_ema_beta", &r.ema_beta));
  RETURN_IF_ERROR(field("routing_capacity_factor", &r.capacity_factor));
  int renormalize = 0;
  RETURN_IF_ERROR(field("routing_renormalize", &renormalize));
  r.renormalize = renormalize != 0;
  {
    auto method = router::ParseRoutingMethod(meta["method"]);
    if (!method.ok()) {
      return absl::DataLossError(absl::StrCat(where, ": meta.txt: ", method.status().message()));
    }
    r.method = *method;
  }
  if (auto s = router::ValidateRoutingConfig(r); !s.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": meta.txt: ", s.message()));
  }
  ASSIGN_OR_RETURN(out.dense, Unpickle(files[kDenseFile], absl::StrCat(where, ": dense.pt")));
  // ReadVerified read and checked every file the MANIFEST lists.
  for (int g = 0; g < r.num_groups; ++g) {
    auto it = files.find(ExpertsFile(g));
    if (it == files.end()) {
      return absl::DataLossError(
          absl::StrCat(where, ": the MANIFEST does not list ", ExpertsFile(g)));
    }
    ASSIGN_OR_RETURN(auto state, Unpickle(it->second, absl::StrCat(where, ": ", ExpertsFile(g))));
    out.experts.push_back(std::move(state));
  }
  return out;
}

absl::Status RestoreDenseState(const CheckpointContents& contents, TransformerLM& model) {
  ASSIGN_OR_RETURN(const auto pairs,
                   MatchDenseState(model, contents.dense,
                                   absl::StrCat("checkpoint ", contents.dir)));
  return CatchTorchErrors([&] {
    torch::NoGradGuard no_grad;
    for (const auto& [live, saved] : pairs) live.copy_(saved);
    return absl::OkStatus();
  });
}

}  // namespace himoe::trainer
