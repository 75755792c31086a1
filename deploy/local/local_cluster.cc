#include "deploy/local/local_cluster.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "himoe/v1/router.grpc.pb.h"

namespace himoe::local {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kStopGrace = std::chrono::seconds(10);
constexpr auto kReadyPoll = std::chrono::milliseconds(100);
constexpr auto kRpcTimeout = std::chrono::seconds(2);
constexpr int kLogTailLines = 20;
constexpr size_t kLogTailBytes = 64 << 10;  // only the end of a long log is read
// wait_status() of a child that something else reaped (waitpid: ECHILD).
constexpr int kUnknownStatus = -1;

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string SelfDir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  return Dirname(buf);
}

absl::Status MakeDirs(const std::string& path) {
  std::string prefix;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    absl::StrAppend(&prefix, part, "/");
    if (part.empty() || part == ".") continue;
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::UnavailableError(
          absl::StrCat("cannot create directory ", prefix, ": ", std::strerror(errno)));
    }
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(path, " is not a directory"));
  }
  return absl::OkStatus();
}

void WriteSmallFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
  }
  std::rename(tmp.c_str(), path.c_str());
}

// open() with O_CLOEXEC, moved to a descriptor >= 3 so that the child's dup2
// onto 0/1/2 always makes a fresh descriptor (which does not inherit the
// close-on-exec flag).
int OpenAbove2(const char* path, int flags, mode_t mode) {
  const int fd = open(path, flags | O_CLOEXEC, mode);
  if (fd < 0 || fd > 2) return fd;
  const int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  const int err = errno;
  close(fd);
  errno = err;
  return moved;
}

}  // namespace

// --- ChildProcess ---------------------------------------------------------------

ChildProcess::ChildProcess(std::string name, std::string log_path, std::string pid_file)
    : name_(std::move(name)), log_path_(std::move(log_path)), pid_file_(std::move(pid_file)) {}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : name_(std::move(other.name_)),
      log_path_(std::move(other.log_path_)),
      pid_file_(std::move(other.pid_file_)),
      pid_(std::exchange(other.pid_, -1)),
      exited_(other.exited_),
      wait_status_(other.wait_status_) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    Kill();
    name_ = std::move(other.name_);
    log_path_ = std::move(other.log_path_);
    pid_file_ = std::move(other.pid_file_);
    pid_ = std::exchange(other.pid_, -1);
    exited_ = other.exited_;
    wait_status_ = other.wait_status_;
  }
  return *this;
}

ChildProcess::~ChildProcess() { Kill(); }

absl::Status ChildProcess::Spawn(const std::vector<std::string>& args) {
  if (pid_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(name_, " was already started"));
  }
  if (args.empty()) return absl::InvalidArgumentError("Spawn: empty command line");
  // Everything the child needs is prepared here: after fork it may only make
  // async-signal-safe calls (another thread may hold the malloc lock).
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const int log_fd = OpenAbove2(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (log_fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open ", log_path_, ": ", std::strerror(errno)));
  }
  const int null_fd = OpenAbove2("/dev/null", O_RDONLY, 0);
  if (null_fd < 0) {
    const int err = errno;
    close(log_fd);
    return absl::UnavailableError(absl::StrCat("cannot open /dev/null: ", std::strerror(err)));
  }
  {
    // The command line heads the log, for whoever reads it later.
    std::string line = "#";
    for (const std::string& a : args) absl::StrAppend(&line, " ", a);
    line += "\n";
    if (write(log_fd, line.data(), line.size()) < 0) {
      // Not fatal: the service's own output still goes there.
    }
  }
  rlimit nofile = {};
  getrlimit(RLIMIT_NOFILE, &nofile);
  const int max_fd = nofile.rlim_cur == RLIM_INFINITY || nofile.rlim_cur > 65536
                         ? 65536
                         : static_cast<int>(nofile.rlim_cur);
  sigset_t empty;
  sigemptyset(&empty);
  const pid_t parent = getpid();
  static const char kExecFailed[] = "himoe: exec failed: ";
  const size_t argv0_size = args[0].size();

  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(log_fd);
    close(null_fd);
    return absl::UnavailableError(absl::StrCat("fork failed: ", std::strerror(err)));
  }
  if (pid == 0) {
    // Only async-signal-safe calls from here to exec.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    dup2(null_fd, STDIN_FILENO);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    if (syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
      for (int fd = 3; fd < max_fd; ++fd) close(fd);
    }
    signal(SIGPIPE, SIG_DFL);  // gRPC ignores it; exec keeps an ignored signal ignored
    sigprocmask(SIG_SETMASK, &empty, nullptr);
    execv(argv[0], argv.data());
    if (write(STDERR_FILENO, kExecFailed, sizeof(kExecFailed) - 1) >= 0 &&
        write(STDERR_FILENO, argv[0], argv0_size) >= 0) {
      (void)!write(STDERR_FILENO, "\n", 1);
    }
    _exit(127);
  }
  close(log_fd);
  close(null_fd);
  pid_ = pid;
  exited_ = false;
  wait_status_ = 0;
  if (!pid_file_.empty()) WriteSmallFile(pid_file_, absl::StrCat(pid, "\n"));
  return absl::OkStatus();
}

bool ChildProcess::Reap() {
  if (exited_ || pid_ <= 0) return true;  // (a child never started counts as ended)
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid_, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) {
    exited_ = true;
    wait_status_ = status;
    return true;
  }
  if (r < 0 && errno == ECHILD) {  // reaped by someone else (SIGCHLD ignored?)
    exited_ = true;
    wait_status_ = kUnknownStatus;
    return true;
  }
  return false;
}

std::string ChildProcess::DescribeExit() const {
  if (!exited_) return pid_ > 0 ? "is running" : "was not started";
  const int status = wait_status_;
  if (status == kUnknownStatus) return "has ended (exit status unknown)";
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (",
                        strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("ended with wait status ", status);
}

std::string ChildProcess::LogTail(int lines) const {
  std::ifstream in(log_path_, std::ios::binary);
  if (!in) return "    (no log)\n";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff from = size > static_cast<std::streamoff>(kLogTailBytes)
                                  ? size - static_cast<std::streamoff>(kLogTailBytes)
                                  : 0;
  in.seekg(from);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> all = absl::StrSplit(text, '\n');
  if (!all.empty() && all.back().empty()) all.pop_back();
  if (from > 0 && !all.empty()) all.erase(all.begin());  // a partial first line
  std::string out;
  const size_t first = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0;
  for (size_t i = first; i < all.size(); ++i) absl::StrAppend(&out, "    | ", all[i], "\n");
  return out.empty() ? "    (log is empty)\n" : out;
}

void ChildProcess::Terminate() {
  if (!Reap()) kill(pid_, SIGTERM);
}

void ChildProcess::Kill() {
  if (Reap()) return;
  kill(pid_, SIGKILL);
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid_, &status, 0);
  } while (r < 0 && errno == EINTR);
  exited_ = true;
  wait_status_ = r == pid_ ? status : kUnknownStatus;
}

// --- Waiting and stopping ----------------------------------------------------------

bool SleepPause(std::chrono::milliseconds d) {
  std::this_thread::sleep_for(d);
  return false;
}

bool WaitForExit(const std::vector<ChildProcess*>& children, Clock::time_point deadline,
                 const PauseFn& pause) {
  while (true) {
    bool all = true;
    for (ChildProcess* c : children) all = c->Reap() && all;
    if (all) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    const auto d = std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(50));
    if (pause ? pause(d) : SleepPause(d)) return false;
  }
}

void StopChildren(const std::vector<ChildProcess*>& children, Clock::time_point deadline,
                  const PauseFn& pause, const std::function<void(const ChildProcess&)>& on_kill) {
  for (ChildProcess* c : children) c->Terminate();
  WaitForExit(children, deadline, pause);
  for (ChildProcess* c : children) {
    if (c->Reap()) continue;
    if (on_kill) on_kill(*c);
    c->Kill();
  }
}

absl::Status WaitUntilReady(std::vector<ReadyTarget>& targets,
                            const std::vector<ChildProcess*>& watched, Clock::time_point deadline,
                            std::chrono::seconds timeout, std::chrono::milliseconds poll,
                            const PauseFn& pause) {
  std::vector<size_t> pending;
  for (size_t i = 0; i < targets.size(); ++i) pending.push_back(i);
  std::vector<std::string> last(targets.size(), "not probed yet");
  while (true) {
    std::vector<size_t> still;
    for (size_t i : pending) {
      const absl::Status s = targets[i].probe();
      if (!s.ok()) {
        last[i] = std::string(s.message());
        still.push_back(i);
      }
    }
    pending.swap(still);
    if (pending.empty()) return absl::OkStatus();
    for (ChildProcess* c : watched) {
      if (c->started() && c->Reap()) {
        return absl::UnavailableError(absl::StrCat(c->name(), " (pid ", c->pid(), ") ",
                                                   c->DescribeExit(), "; last lines of ",
                                                   c->log_path(), ":\n", c->LogTail(kLogTailLines)));
      }
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      std::string message;
      for (size_t i : pending) {
        const ReadyTarget& t = targets[i];
        absl::StrAppend(&message, t.child->name(),
                        t.address.empty() ? "" : absl::StrCat(" at ", t.address), " (pid ",
                        t.child->pid(), ") is not ready after ", timeout.count(),
                        " s (last probe: ", last[i], "); last lines of ", t.child->log_path(),
                        ":\n", t.child->LogTail(kLogTailLines));
      }
      return absl::DeadlineExceededError(message);
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    const auto d = std::clamp(left, std::chrono::milliseconds(1), poll);
    if (pause ? pause(d) : SleepPause(d)) {
      return absl::CancelledError("interrupted while waiting for the services to get ready");
    }
  }
}

// --- Probes --------------------------------------------------------------------------

std::optional<ServicePorts> ReadPortFile(const std::string& path, bool want_metrics_port) {
  std::ifstream in(path);
  ServicePorts ports;
  if (!(in >> ports.port) || ports.port <= 0) return std::nullopt;
  if (!(in >> ports.metrics_port)) {
    if (want_metrics_port) return std::nullopt;
    ports.metrics_port = 0;
  }
  return ports;
}

std::shared_ptr<grpc::Channel> ProbeChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

absl::Status ProbeExpertInfo(const std::shared_ptr<grpc::Channel>& channel, int group_id,
                             int num_groups, int64_t d_model) {
  const auto stub = v1::ExpertService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  v1::ExpertInfoResponse info;
  const grpc::Status status = stub->Info(&context, v1::ExpertInfoRequest(), &info);
  if (!status.ok()) return absl::UnavailableError(absl::StrCat("Info: ", status.error_message()));
  if (info.group_id() != group_id || info.num_groups() != num_groups ||
      info.d_model() != d_model) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Info answered group ", info.group_id(), " of ", info.num_groups(), ", d_model ",
        info.d_model(), " (expected group ", group_id, " of ", num_groups, ", d_model ", d_model,
        "): another service holds this port"));
  }
  return absl::OkStatus();
}

absl::Status ProbeRouterInfo(const std::shared_ptr<grpc::Channel>& channel) {
  const auto stub = v1::RouterService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  v1::RouterInfoResponse info;
  const grpc::Status status = stub->Info(&context, v1::RouterInfoRequest(), &info);
  if (!status.ok()) return absl::UnavailableError(absl::StrCat("Info: ", status.error_message()));
  return absl::OkStatus();
}

// --- Command lines, binaries, directories ------------------------------------------------

std::vector<std::string> ExpertCommandLine(const std::string& binary,
                                           const ExpertProcessOptions& options, int group_id,
                                           const std::string& host, int port,
                                           const std::string& port_file) {
  return {
      binary,
      absl::StrCat("--address=", host),
      absl::StrCat("--port=", port),
      absl::StrCat("--group_id=", group_id),
      absl::StrCat("--num_groups=", options.num_groups),
      absl::StrCat("--num_experts=", options.num_experts),
      absl::StrCat("--num_layers=", options.num_layers),
      absl::StrCat("--d_model=", options.d_model),
      absl::StrCat("--d_ff=", options.d_ff),
      absl::StrCat("--seed=", options.seed),
      absl::StrCat("--dtype=", options.dtype.empty() ? "float32" : options.dtype),
      absl::StrCat("--device=", options.device.empty() ? "cpu" : options.device),
      absl::StrCat("--threads=", options.threads),
      absl::StrCat("--port_file=", port_file),
  };
}

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

std::string AbsolutePath(const std::string& path) {
  char buf[PATH_MAX];
  if (realpath(path.c_str(), buf) != nullptr) return buf;
  return path;
}

absl::StatusOr<std::string> FindBinary(const std::string& name, const std::string& subdir,
                                       const std::string& bin_dir) {
  std::vector<std::string> candidates;
  if (!bin_dir.empty()) {
    candidates = {absl::StrCat(bin_dir, "/", name), absl::StrCat(bin_dir, "/", subdir, "/", name),
                  absl::StrCat(bin_dir, "/../../", subdir, "/", name)};
  } else {
    const std::string self = SelfDir();
    candidates = {absl::StrCat(self, "/", name), absl::StrCat(self, "/../../", subdir, "/", name),
                  absl::StrCat(self, "/../", subdir, "/", name)};
  }
  for (const std::string& c : candidates) {
    if (IsExecutableFile(c)) return AbsolutePath(c);
  }
  std::string tried;
  for (const std::string& c : candidates) absl::StrAppend(&tried, "\n  ", c);
  return absl::NotFoundError(absl::StrCat("cannot find the ", name, " executable; tried:", tried,
                                          "\nbuild it (ninja ",
                                          absl::StrReplaceAll(name, {{"-", "_"}}), "_main)"));
}

absl::StatusOr<std::string> PrepareLogDir(const std::string& dir, const std::string& prefix) {
  if (dir.empty()) {
    std::string templ = absl::StrCat("/tmp/", prefix, "-XXXXXX");
    if (mkdtemp(templ.data()) == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("cannot create a log directory under /tmp: ", std::strerror(errno)));
    }
    return templ;
  }
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;
  return AbsolutePath(dir);
}

// --- LocalExpertCluster ---------------------------------------------------------------

namespace {

std::string PortFile(const std::string& log_dir, int g) {
  return absl::StrCat(log_dir, "/expert-", g, ".port");
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalExpertCluster>> LocalExpertCluster::Start(
    const ExpertProcessOptions& options) {
  const int m = options.num_groups;
  if (m < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("local experts: num_groups must be >= 1, got ", m));
  }
  if (options.ready_timeout.count() <= 0) {
    return absl::InvalidArgumentError("local experts: ready_timeout must be > 0");
  }
  std::string binary;
  if (!options.binary.empty()) {
    if (!IsExecutableFile(options.binary)) {
      return absl::NotFoundError(absl::StrCat("the himoe-expert binary '", options.binary,
                                              "' is not an executable file"));
    }
    binary = AbsolutePath(options.binary);
  } else {
    absl::StatusOr<std::string> found = FindBinary("himoe-expert", "expert_service");
    if (!found.ok()) return found.status();
    binary = *std::move(found);
  }
  absl::StatusOr<std::string> log_dir = PrepareLogDir(options.log_dir, "himoe-experts");
  if (!log_dir.ok()) return log_dir.status();

  // From here on, the destructor stops whatever was started on every error path.
  std::unique_ptr<LocalExpertCluster> cluster(new LocalExpertCluster());
  cluster->log_dir_ = *std::move(log_dir);
  const std::string& dir = cluster->log_dir_;
  cluster->children_.reserve(m);
  for (int g = 0; g < m; ++g) {
    const std::string port_file = PortFile(dir, g);
    std::remove(port_file.c_str());  // a stale one would pass for "ready"
    ChildProcess child(absl::StrCat("expert group ", g), absl::StrCat(dir, "/expert-", g, ".log"),
                       absl::StrCat(dir, "/expert-", g, ".pid"));
    std::vector<std::string> argv =
        ExpertCommandLine(binary, options, g, "127.0.0.1", 0, port_file);
    if (options.metrics_port_base >= 0) {
      argv.push_back(absl::StrCat(
          "--metrics_port=", options.metrics_port_base == 0 ? 0 : options.metrics_port_base + g));
      argv.push_back("--metrics_address=127.0.0.1");
    }
    const absl::Status s = child.Spawn(argv);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("cannot start expert group ", g, ": ", s.message()));
    }
    cluster->children_.push_back(std::move(child));
  }

  // Ready = our own process wrote its port file, and the port answers Info as
  // group g.
  std::vector<std::shared_ptr<grpc::Channel>> channels(m);
  std::vector<std::string> addresses(m), metrics_addresses;
  if (options.metrics_port_base >= 0) metrics_addresses.resize(m);
  std::vector<ReadyTarget> targets(m);
  std::vector<ChildProcess*> watched;
  for (int g = 0; g < m; ++g) {
    watched.push_back(&cluster->children_[g]);
    targets[g].child = &cluster->children_[g];
    targets[g].probe = [&, g]() -> absl::Status {
      if (channels[g] == nullptr) {
        const bool metrics = options.metrics_port_base >= 0;
        const std::optional<ServicePorts> ports = ReadPortFile(PortFile(dir, g), metrics);
        if (!ports) return absl::UnavailableError("no port file yet (still starting)");
        addresses[g] = absl::StrCat("127.0.0.1:", ports->port);
        if (metrics) metrics_addresses[g] = absl::StrCat("127.0.0.1:", ports->metrics_port);
        targets[g].address = addresses[g];
        channels[g] = ProbeChannel(addresses[g]);
      }
      return ProbeExpertInfo(channels[g], g, m, options.d_model);
    };
  }
  const absl::Status ready =
      WaitUntilReady(targets, watched, Clock::now() + options.ready_timeout,
                     options.ready_timeout, kReadyPoll, SleepPause);
  if (!ready.ok()) return ready;  // (the destructor stops the processes)
  cluster->addresses_ = std::move(addresses);
  cluster->metrics_addresses_ = std::move(metrics_addresses);
  for (const ChildProcess& c : cluster->children_) cluster->pids_.push_back(c.pid());
  return cluster;
}

LocalExpertCluster::~LocalExpertCluster() { Stop(); }

absl::Status LocalExpertCluster::CheckAlive() {
  if (stopped_) return absl::FailedPreconditionError("the local expert processes were stopped");
  for (size_t g = 0; g < children_.size(); ++g) {
    ChildProcess& c = children_[g];
    if (c.Reap()) {
      return absl::UnavailableError(absl::StrCat(
          c.name(), " (pid ", c.pid(), g < addresses_.size() ? ", " + addresses_[g] : "", ") ",
          c.DescribeExit(), "; last lines of ", c.log_path(), ":\n", c.LogTail(kLogTailLines)));
    }
  }
  return absl::OkStatus();
}

void LocalExpertCluster::Stop() {
  if (stopped_) return;
  stopped_ = true;
  std::vector<ChildProcess*> all;
  for (ChildProcess& c : children_) all.push_back(&c);
  StopChildren(all, Clock::now() + kStopGrace, SleepPause, [](const ChildProcess& c) {
    std::fprintf(stderr, "himoe: %s (pid %d) did not stop within %d s: SIGKILL\n",
                 c.name().c_str(), c.pid(), static_cast<int>(kStopGrace.count()));
  });
  for (size_t g = 0; g < children_.size(); ++g) {  // stale once the processes are gone
    std::remove(children_[g].pid_file().c_str());
    std::remove(PortFile(log_dir_, static_cast<int>(g)).c_str());
  }
}

}  // namespace himoe::local
