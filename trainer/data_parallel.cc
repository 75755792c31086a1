#include "trainer/data_parallel.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"

namespace himoe::trainer {
namespace {

// An environment variable as an int in [lo, hi]; `fallback` when unset.
absl::StatusOr<int> IntFromEnvironment(const char* name, int fallback, int lo, int hi) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  int parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed < lo || parsed > hi) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", name,
                                                   ": expected an integer in [", lo, ", ", hi,
                                                   "], got '", value, "'"));
  }
  return parsed;
}

std::shared_ptr<::gloo::transport::Device> GlooDevice(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (master_addr == "localhost" || absl::StartsWith(master_addr, "127.")) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

constexpr auto kHeartbeat = std::chrono::milliseconds(300);

}  // namespace

absl::StatusOr<DataParallelOptions> DataParallelOptionsFromEnvironment(DataParallelOptions o) {
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr) {
    o.master_addr = addr;
  }
  absl::StatusOr<int> port = IntFromEnvironment("MASTER_PORT", o.master_port, 0, 65535);
  absl::StatusOr<int> world = IntFromEnvironment("WORLD_SIZE", o.world_size, 1, 1 << 16);
  if (!port.ok()) return port.status();
  if (!world.ok()) return world.status();
  absl::StatusOr<int> rank = IntFromEnvironment("RANK", o.rank, 0, *world - 1);
  if (!rank.ok()) return rank.status();
  o.master_port = *port;
  o.world_size = *world;
  o.rank = *rank;
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE"); agent != nullptr) {
    o.store_hosted = absl::EqualsIgnoreCase(agent, "true") || std::string(agent) == "1";
  }
  return o;
}

struct DataParallel::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> main;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroupGloo>> lanes;
  int64_t broadcasts = 0;
  // Every rank bumps its counter in the store while it lives, so that a
  // failed collective can name the ranks that stopped.
  std::thread heartbeat;
  std::mutex mu;
  std::condition_variable stop_cv;
  bool stopping = false;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    stop_cv.notify_all();
    if (heartbeat.joinable()) heartbeat.join();
  }
};

DataParallel::DataParallel(const DataParallelOptions& options, std::unique_ptr<Impl> impl)
    : options_(options), impl_(std::move(impl)) {}

DataParallel::~DataParallel() = default;

absl::StatusOr<std::unique_ptr<DataParallel>> DataParallel::Create(const DataParallelOptions& o,
                                                                   const std::string& fingerprint) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size || o.lanes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data parallel: rank ", o.rank, " of world size ", o.world_size, " with ",
                     o.lanes, " lanes; expected 0 <= rank < world size and lanes >= 1"));
  }
  if (o.master_port < 0 || o.master_port > 65535 ||
      (o.master_port == 0 && (o.rank != 0 || o.store_hosted))) {
    return absl::InvalidArgumentError(
        absl::StrCat("data parallel: master port ", o.master_port,
                     "; expected 1..65535 (0 only on rank 0 when it serves the store)"));
  }
  auto impl = std::make_unique<Impl>();
  const std::string where = absl::StrCat(o.master_addr, ":", o.master_port);
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(o.master_port);
    so.isServer = o.rank == 0 && !o.store_hosted;
    so.numWorkers = o.world_size;
    so.waitWorkers = false;
    so.timeout = o.timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
    if (so.isServer && o.on_listening) o.on_listening(impl->store->getPort());
    const auto group = [&](const std::string& prefix, int threads) {
      auto options = c10d::ProcessGroupGloo::Options::create(o.timeout);
      options->devices.push_back(GlooDevice(o.master_addr));
      options->threads = threads;
      auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, impl->store);
      return c10::make_intrusive<c10d::ProcessGroupGloo>(store, o.rank, o.world_size, options);
    };
    impl->main = group("main", 2);
    for (int lane = 0; lane < o.lanes; ++lane) {
      impl->lanes.push_back(group(absl::StrCat("lane", lane), 1));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("data parallel: rank ", o.rank, " of ", o.world_size,
                                               " could not join the run at ", where, ": ",
                                               e.what()));
  }
  std::unique_ptr<DataParallel> dp(new DataParallel(o, std::move(impl)));
  if (o.world_size > 1) {
    Impl* state = dp->impl_.get();
    const std::string key = absl::StrCat("alive/", o.rank);
    state->heartbeat = std::thread([state, key] {
      std::unique_lock<std::mutex> lock(state->mu);
      while (!state->stopping) {
        lock.unlock();
        try {
          state->store->add(key, 1);
        } catch (const std::exception&) {
          // The store is gone; the next collective reports it.
        }
        lock.lock();
        state->stop_cv.wait_for(lock, kHeartbeat, [state] { return state->stopping; });
      }
    });
  }
  // Every rank's settings must match rank 0's.
  absl::StatusOr<std::string> theirs = dp->Broadcast(fingerprint);
  if (!theirs.ok()) return theirs.status();
  if (*theirs != fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "data parallel: rank ", o.rank, "'s settings differ from rank 0's (", fingerprint,
        " against ", *theirs, "); every rank must run the same model, batch and routing"));
  }
  return dp;
}

absl::Status DataParallel::Failed(const std::string& what, const std::exception& e) {
  std::string stopped;
  if (options_.world_size > 1) {
    // Ranks whose heartbeat stood still over a few beats.
    try {
      std::vector<int64_t> before(options_.world_size);
      for (int r = 0; r < options_.world_size; ++r) {
        before[r] = impl_->store->add(absl::StrCat("alive/", r), 0);
      }
      std::this_thread::sleep_for(4 * kHeartbeat);
      std::vector<int> still;
      for (int r = 0; r < options_.world_size; ++r) {
        if (r != options_.rank && impl_->store->add(absl::StrCat("alive/", r), 0) == before[r]) {
          still.push_back(r);
        }
      }
      if (!still.empty()) {
        stopped =
            absl::StrCat("; rank ", absl::StrJoin(still, ", rank "), " stopped (no heartbeat)");
      }
    } catch (const std::exception&) {
      stopped = absl::StrCat("; the rendezvous store at ", options_.master_addr, ":",
                             options_.master_port, " is gone",
                             options_.store_hosted ? "" : " (rank 0 serves it: rank 0 stopped)");
    }
  }
  return absl::UnavailableError(absl::StrCat("data parallel: rank ", options_.rank, " of ",
                                             options_.world_size, ": ", what, " failed: ", e.what(),
                                             stopped));
}

absl::Status DataParallel::AllReduceSum(const std::vector<at::Tensor>& tensors,
                                        int64_t bucket_bytes) {
  if (options_.world_size == 1 || tensors.empty()) return absl::OkStatus();
  const at::ScalarType dtype = tensors[0].defined() ? tensors[0].scalar_type() : at::kFloat;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.scalar_type() != dtype || !t.is_contiguous() || !t.device().is_cpu() ||
        (dtype != at::kFloat && dtype != at::kDouble)) {
      return absl::InvalidArgumentError(
          "data parallel: an all-reduce takes defined, contiguous CPU tensors, all float32 or all "
          "float64");
    }
  }
  size_t begin = 0;
  try {
    while (begin < tensors.size()) {
      size_t end = begin;
      int64_t bytes = 0;
      std::vector<at::Tensor> flat;
      while (end < tensors.size() &&
             (end == begin || bytes + tensors[end].nbytes() <= static_cast<size_t>(bucket_bytes))) {
        bytes += tensors[end].nbytes();
        flat.push_back(tensors[end].view(-1));
        ++end;
      }
      std::vector<at::Tensor> bucket{at::cat(flat)};
      impl_->main->allreduce(bucket)->wait();
      int64_t offset = 0;
      for (size_t i = begin; i < end; ++i) {
        const int64_t n = tensors[i].numel();
        tensors[i].view(-1).copy_(bucket[0].narrow(0, offset, n));
        offset += n;
      }
      begin = end;
    }
  } catch (const std::exception& e) {
    return Failed("the gradient all-reduce", e);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<at::Tensor>> DataParallel::AllGather(const at::Tensor& tensor,
                                                                int lane) {
  if (lane < 0 || lane >= options_.lanes) {
    return absl::InvalidArgumentError(
        absl::StrCat("data parallel: lane ", lane, " of ", options_.lanes));
  }
  if (options_.world_size == 1) return std::vector<at::Tensor>{tensor};
  try {
    std::vector<at::Tensor> input{tensor.contiguous()};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < options_.world_size; ++r) output[0].push_back(at::empty_like(input[0]));
    impl_->lanes[lane]->allgather(output, input)->wait();
    return std::move(output[0]);
  } catch (const std::exception& e) {
    return Failed("the routers' all-gather", e);
  }
}

absl::StatusOr<std::string> DataParallel::Broadcast(const std::string& value) {
  if (options_.world_size == 1) return value;
  const std::string key = absl::StrCat("broadcast/", impl_->broadcasts++);
  try {
    if (options_.rank == 0) {
      impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
      return value;
    }
    const std::vector<uint8_t> bytes = impl_->store->get(key);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    return Failed("a broadcast from rank 0", e);
  }
}

absl::Status DataParallel::Barrier() {
  if (options_.world_size == 1) return absl::OkStatus();
  try {
    impl_->main->barrier()->wait();
  } catch (const std::exception& e) {
    return Failed("a barrier", e);
  }
  return absl::OkStatus();
}

struct RendezvousStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

RendezvousStore::RendezvousStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RendezvousStore::~RendezvousStore() = default;

int RendezvousStore::port() const { return impl_->store->getPort(); }

absl::StatusOr<std::unique_ptr<RendezvousStore>> RendezvousStore::Serve(
    int port, int world_size, std::chrono::milliseconds timeout) {
  if (port < 0 || port > 65535 || world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous store: port ", port, " for ", world_size, " ranks"));
  }
  auto impl = std::make_unique<Impl>();
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = true;
    so.numWorkers = world_size;
    so.waitWorkers = false;
    so.timeout = timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("rendezvous store: cannot listen on port ", port, ": ", e.what()));
  }
  return std::unique_ptr<RendezvousStore>(new RendezvousStore(std::move(impl)));
}

}  // namespace himoe::trainer
