#include "deploy/local/process_set.h"

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
#include "common/expert_shape.h"
#include "common/file_util.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "himoe/v1/router.grpc.pb.h"
#include "proto/tls_credentials.h"

namespace himoe::local {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kRpcTimeout = std::chrono::seconds(2);
constexpr int kLogTailLines = 20;
constexpr size_t kLogTailBytes = 64 << 10;  // only the end of a long log is read
// wait_status() of a child that something else reaped (waitpid: ECHILD).
constexpr int kUnknownStatus = -1;

std::string SelfDir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  return Dirname(buf);
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

// What a child needs after fork, all prepared before it: from fork to exec it
// may only make async-signal-safe calls (another thread may hold the malloc
// lock).
struct ExecPlan {
  std::vector<char*> argv;  // null-terminated
  size_t argv0_size = 0;
  int log_fd = -1;   // stdout, stderr
  int null_fd = -1;  // stdin
  int max_fd = 0;    // close_range fallback
  pid_t parent = 0;
  sigset_t empty_mask;
};

void CloseFds(const ExecPlan& plan) {
  if (plan.log_fd >= 0) close(plan.log_fd);
  if (plan.null_fd >= 0) close(plan.null_fd);
}

// Opens the log (truncated, headed by the command line) and /dev/null.
absl::Status PrepareExec(const std::vector<std::string>& args, const std::string& log_path,
                         ExecPlan& plan) {
  for (const std::string& a : args) plan.argv.push_back(const_cast<char*>(a.c_str()));
  plan.argv.push_back(nullptr);
  plan.argv0_size = args[0].size();
  plan.log_fd = OpenAbove2(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (plan.log_fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open ", log_path, ": ", std::strerror(errno)));
  }
  plan.null_fd = OpenAbove2("/dev/null", O_RDONLY, 0);
  if (plan.null_fd < 0) {
    const int err = errno;
    CloseFds(plan);
    return absl::UnavailableError(absl::StrCat("cannot open /dev/null: ", std::strerror(err)));
  }
  std::string line = "#";
  for (const std::string& a : args) absl::StrAppend(&line, " ", a);
  line += "\n";
  if (write(plan.log_fd, line.data(), line.size()) < 0) {
    // Not fatal: the service's own output still goes there.
  }
  rlimit nofile = {};
  getrlimit(RLIMIT_NOFILE, &nofile);
  plan.max_fd = nofile.rlim_cur == RLIM_INFINITY || nofile.rlim_cur > 65536
                    ? 65536
                    : static_cast<int>(nofile.rlim_cur);
  plan.parent = getpid();
  sigemptyset(&plan.empty_mask);
  return absl::OkStatus();
}

// The forked child: only async-signal-safe calls from here to exec.
[[noreturn]] void ExecChild(const ExecPlan& plan) {
  static const char kExecFailed[] = "himoe: exec failed: ";
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != plan.parent) _exit(127);  // the parent died before prctl
  // A process group of its own: a terminal's Ctrl-C (SIGINT to the
  // foreground group) reaches the parent only, which stops its children when
  // it is ready to (a trainer ends its step and checkpoints first).
  setpgid(0, 0);
  dup2(plan.null_fd, STDIN_FILENO);
  dup2(plan.log_fd, STDOUT_FILENO);
  dup2(plan.log_fd, STDERR_FILENO);
  if (syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
    for (int fd = 3; fd < plan.max_fd; ++fd) close(fd);
  }
  signal(SIGPIPE, SIG_DFL);  // gRPC ignores it; exec keeps an ignored signal ignored
  sigprocmask(SIG_SETMASK, &plan.empty_mask, nullptr);
  execv(plan.argv[0], plan.argv.data());
  if (write(STDERR_FILENO, kExecFailed, sizeof(kExecFailed) - 1) >= 0 &&
      write(STDERR_FILENO, plan.argv[0], plan.argv0_size) >= 0) {
    (void)!write(STDERR_FILENO, "\n", 1);
  }
  _exit(127);
}

// Polls until every child has ended (true), or until `deadline` or `pause`
// cutting short (false).
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

// One Info call (kRpcTimeout) to a Service's stub; Unavailable "Info: ..." on
// failure.
template <typename Service, typename Request, typename Response>
absl::Status CallInfo(const std::shared_ptr<grpc::Channel>& channel, Response* response) {
  const auto stub = Service::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  const grpc::Status status = stub->Info(&context, Request(), response);
  if (!status.ok()) return absl::UnavailableError(absl::StrCat("Info: ", status.error_message()));
  return absl::OkStatus();
}

// "<name> (pid N[, address]) exited with code 1; last lines of <log>:\n<tail>".
std::string DescribeEnded(const ServiceSet::Service& s) {
  const ChildProcess& c = s.process;
  return absl::StrCat(c.name(), " (pid ", c.pid(), s.address.empty() ? "" : ", ", s.address, ") ",
                      c.DescribeExit(), "; last lines of ", c.log_path(), ":\n",
                      c.LogTail(kLogTailLines));
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
  ExecPlan plan;
  HIMOE_RETURN_IF_ERROR(PrepareExec(args, log_path_, plan));
  const pid_t pid = fork();
  if (pid == 0) ExecChild(plan);
  const int err = errno;
  CloseFds(plan);
  if (pid < 0) return absl::UnavailableError(absl::StrCat("fork failed: ", std::strerror(err)));
  pid_ = pid;
  exited_ = false;
  wait_status_ = 0;
  if (!pid_file_.empty()) {
    // Best effort: the pid file is for the user, the process runs regardless.
    (void)WriteFileAtomically(pid_file_, absl::StrCat(pid, "\n"));
  }
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

bool SleepPause(std::chrono::milliseconds d) {
  std::this_thread::sleep_for(d);
  return false;
}

// --- ServiceSet ----------------------------------------------------------------------

ServiceSet::~ServiceSet() { Stop(); }

absl::Status ServiceSet::Start(ServiceSpec spec) {
  if (!spec.port_file.empty()) std::remove(spec.port_file.c_str());
  ChildProcess process(spec.name, spec.log_path, spec.pid_file);
  Service s(std::move(spec), std::move(process));
  s.address = s.spec.address;
  if (const absl::Status status = s.process.Spawn(s.spec.argv); !status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("cannot start ", s.spec.name, ": ", status.message()));
  }
  stopped_ = false;
  services_.push_back(std::move(s));
  return absl::OkStatus();
}

// Ready = our own process wrote its port file (it is the one serving, not a
// stale process on that port) and the probe passes.
absl::Status ServiceSet::Probe(Service& s) {
  if (s.channel == nullptr) {
    s.ports = ReadPortFile(s.spec.port_file, s.spec.want_metrics_port);
    if (!s.ports) return absl::UnavailableError("no port file yet (still starting)");
    const std::string target = JoinHostPort(s.spec.dial_host, s.ports->port);
    if (s.address.empty()) s.address = target;
    HIMOE_ASSIGN_OR_RETURN(s.channel, ProbeChannel(target, s.spec.tls));
  }
  HIMOE_RETURN_IF_ERROR(s.spec.probe ? s.spec.probe(s.channel) : absl::OkStatus());
  s.ready = true;
  s.channel.reset();  // no idle client left on the service
  return absl::OkStatus();
}

absl::Status ServiceSet::WaitUntilReady(Clock::time_point deadline, std::chrono::seconds timeout,
                                        std::chrono::milliseconds poll, const PauseFn& pause) {
  std::vector<std::string> last(services_.size(), "not probed yet");
  while (true) {
    bool all = true;
    for (size_t i = 0; i < services_.size(); ++i) {
      if (services_[i].ready) continue;
      if (const absl::Status s = Probe(services_[i]); !s.ok()) {
        last[i] = std::string(s.message());
        all = false;
      }
    }
    if (all) return absl::OkStatus();
    HIMOE_RETURN_IF_ERROR(CheckAlive());
    const auto now = Clock::now();
    if (now >= deadline) {
      std::string message;
      for (size_t i = 0; i < services_.size(); ++i) {
        const Service& s = services_[i];
        if (s.ready) continue;
        absl::StrAppend(&message, s.process.name(),
                        s.address.empty() ? "" : absl::StrCat(" at ", s.address), " (pid ",
                        s.process.pid(), ") is not ready after ", timeout.count(),
                        " s (last probe: ", last[i], "); last lines of ", s.process.log_path(),
                        ":\n", s.process.LogTail(kLogTailLines));
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

absl::Status ServiceSet::CheckAlive() {
  for (Service& s : services_) {
    if (s.process.started() && s.process.Reap()) return absl::UnavailableError(DescribeEnded(s));
  }
  return absl::OkStatus();
}

std::vector<size_t> ServiceSet::Ended() {
  std::vector<size_t> ended;
  for (size_t i = 0; i < services_.size(); ++i) {
    if (services_[i].process.started() && services_[i].process.Reap()) ended.push_back(i);
  }
  return ended;
}

absl::Status ServiceSet::Restart(size_t i, std::vector<std::string> argv) {
  Service& s = services_.at(i);
  s.process.Kill();
  if (!s.spec.port_file.empty()) std::remove(s.spec.port_file.c_str());
  // The ended process's log stays, as <log>.previous.
  std::rename(s.spec.log_path.c_str(), (s.spec.log_path + ".previous").c_str());
  s.spec.argv = std::move(argv);
  s.process = ChildProcess(s.spec.name, s.spec.log_path, s.spec.pid_file);
  s.ports.reset();
  s.ready = false;
  s.channel.reset();
  if (const absl::Status status = s.process.Spawn(s.spec.argv); !status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("cannot restart ", s.spec.name, ": ", status.message()));
  }
  stopped_ = false;
  return absl::OkStatus();
}

void ServiceSet::Stop(const StopOptions& options) {
  if (stopped_) return;
  stopped_ = true;
  const auto deadline = Clock::now() + options.grace;
  std::vector<ChildProcess*> first, all;
  for (Service& s : services_) {
    if (s.spec.stop_first) first.push_back(&s.process);
    all.push_back(&s.process);
  }
  for (ChildProcess* c : first) c->Terminate();
  if (!first.empty()) {
    WaitForExit(first, std::min(deadline, Clock::now() + options.first_share), options.pause);
  }
  for (ChildProcess* c : all) c->Terminate();
  WaitForExit(all, deadline, options.pause);
  for (ChildProcess* c : all) {
    if (c->Reap()) continue;
    if (options.on_kill) options.on_kill(*c);
    c->Kill();
  }
  for (const Service& s : services_) {  // stale once the processes are gone
    if (!s.spec.pid_file.empty()) std::remove(s.spec.pid_file.c_str());
    if (!s.spec.port_file.empty()) std::remove(s.spec.port_file.c_str());
  }
}

std::vector<int> ServiceSet::pids() const {
  std::vector<int> pids;
  for (const Service& s : services_) pids.push_back(s.process.pid());
  return pids;
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

absl::StatusOr<std::shared_ptr<grpc::Channel>> ProbeChannel(const std::string& target,
                                                            const TlsFiles& tls) {
  HIMOE_ASSIGN_OR_RETURN(const std::shared_ptr<grpc::ChannelCredentials> credentials,
                         MakeChannelCredentials(tls));
  grpc::ChannelArguments args;
  // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: that is the minimum connect
  // timeout (expert_service/expert_client.cc).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, credentials, args);
}

absl::Status ProbeExpertInfo(const std::shared_ptr<grpc::Channel>& channel, int group_id,
                             const v1::ExpertShape& shape) {
  v1::ExpertInfoResponse info;
  HIMOE_RETURN_IF_ERROR((CallInfo<v1::ExpertService, v1::ExpertInfoRequest>(channel, &info)));
  if (info.group_id() != group_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("Info answered group ", info.group_id(), " (expected group ", group_id,
                     "): another service holds this port"));
  }
  return CheckExpertShape(shape, info.shape(), absl::StrCat("group ", group_id));
}

absl::Status ProbeRouterInfo(const std::shared_ptr<grpc::Channel>& channel) {
  v1::RouterInfoResponse info;
  return CallInfo<v1::RouterService, v1::RouterInfoRequest>(channel, &info);
}

// --- Binaries, directories ----------------------------------------------------------

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
  if (absl::Status s = CreateDirectories(dir); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot create directory ", s.message()));
  }
  return AbsolutePath(dir);
}

}  // namespace himoe::local
