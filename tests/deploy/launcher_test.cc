// himoe-cluster as a subprocess, with the real himoe-expert and himoe-router
// under it: start, serve, stop on SIGINT; refuse bad cluster files without
// starting anything; stop everything when a service dies; --help.
//
// This process makes itself a child subreaper, so that services the launcher
// failed to reap (or left behind when killed) are re-parented to the test: the
// guards below kill and reap them on every path, and "no child left" is
// checkable with waitpid(-1).

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_cores.h"
#include "common/file_util.h"
#include "common/tensor_codec.h"
#include "proto/tls_credentials.h"
#include "tests/deploy/child_checks.h"
#include "tests/http_get.h"
#include "tests/loopback_ports.h"
#include "tests/temp_dir.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "himoe/v1/router.grpc.pb.h"

extern char** environ;

namespace himoe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

// Generous bounds: a hung launcher fails the test instead of hanging it.
constexpr auto kReadyBound = std::chrono::seconds(180);
constexpr auto kExitBound = std::chrono::seconds(60);
constexpr int kReadyTimeoutFlagS = 120;

// Reads a pid file the launcher writes next to the logs; -1 if absent.
pid_t ReadPid(const std::string& path) {
  std::ifstream in(path);
  pid_t pid = -1;
  if (!(in >> pid)) return -1;
  return pid;
}

// Bounded wait until `pid` no longer exists (a zombie still exists).
bool WaitGone(pid_t pid, std::chrono::seconds bound) {
  const auto until = Clock::now() + bound;
  while (!test_util::ProcessGone(pid)) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The launcher and every service pid it reported: SIGKILLed and reaped on
// every path out of the test.
class LauncherProcess {
 public:
  ~LauncherProcess() { KillAll(); }

  bool Start(const std::vector<std::string>& args, const std::string& stdout_path,
             const std::string& stderr_path) {
    stdout_path_ = stdout_path;
    stderr_path_ = stderr_path;
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 1, stdout_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, 2, stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) pid_ = -1;
    return rc == 0;
  }

  pid_t pid() const { return pid_; }
  std::string Stdout() const { return test_util::ReadTextFile(stdout_path_); }
  std::string Stderr() const { return test_util::ReadTextFile(stderr_path_); }
  std::string Output() const {
    return absl::StrCat("--- stdout:\n", Stdout(), "--- stderr:\n", Stderr());
  }

  void AddServicePid(pid_t pid) {
    if (pid > 0) services_.push_back(pid);
  }

  // Bounded wait for the launcher's exit; its wait status, or nullopt.
  std::optional<int> WaitExit(std::chrono::seconds bound) {
    const auto until = Clock::now() + bound;
    while (pid_ > 0) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return status;
      }
      if (r < 0) return std::nullopt;
      if (Clock::now() >= until) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::nullopt;
  }

  // Bounded wait until stdout holds `text`; false if the launcher exited or
  // time ran out first.
  bool WaitForStdout(const std::string& text, std::chrono::seconds bound) {
    const auto until = Clock::now() + bound;
    while (Clock::now() < until) {
      if (Stdout().find(text) != std::string::npos) return true;
      int status = 0;
      if (pid_ > 0 && waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return Stdout().find(text) != std::string::npos;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  void KillAll() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
    // Services left behind are our children now (subreaper); only those are
    // touched, so a recycled pid of another process is never signalled.
    for (pid_t pid : services_) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
    services_.clear();
  }

 private:
  pid_t pid_ = -1;
  std::vector<pid_t> services_;
  std::string stdout_path_, stderr_path_;
};

std::string BuildRoot() {
  // <build>/expert_service/himoe-expert -> <build>
  return Dirname(Dirname(HIMOE_EXPERT_BINARY));
}

// Group metrics ports: 0 = none.
std::string SmallCluster(int group0_port, int group1_port, int router_port,
                         int group0_metrics = 0, int group1_metrics = 0, int threads = 1,
                         const std::string& router_extra = "") {
  return absl::StrCat(R"(
model {
  num_layers: 1
  d_model: 16
  d_ff: 32
  num_experts: 4
  num_groups: 2
  top_k: 1
  seed: 3
}
routing { method: "himoe" preset: "paper" }
groups { address: "127.0.0.1:)", group0_port, R"(" threads: )", threads, R"( metrics_port: )",
                      group0_metrics, R"( }
groups { address: "127.0.0.1:)", group1_port, R"(" threads: )", threads, R"( metrics_port: )",
                      group1_metrics, R"( }
router { address: "127.0.0.1:)", router_port, R"(" metrics_port: 0 )", router_extra, R"( }
)");
}

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    ASSERT_FALSE(dir_.path().empty());
    ASSERT_TRUE(test_util::PathExists(HIMOE_CLUSTER_BINARY));
    ASSERT_TRUE(test_util::PathExists(HIMOE_EXPERT_BINARY));
    ASSERT_TRUE(test_util::PathExists(HIMOE_ROUTER_BINARY));
  }

  // Writes a 2-group cluster on free loopback ports and starts the launcher on
  // it; returns once it printed its ready line, with the service pids known.
  // With `group_metrics`, each group serves /metrics on a port of its own.
  void StartSmallCluster(LauncherProcess& launcher, const std::vector<std::string>& extra = {},
                         bool group_metrics = false, int threads = 1) {
    const size_t n = group_metrics ? 5 : 3;
    const std::vector<int> ports = test_util::FreeLoopbackPorts(n);
    ASSERT_EQ(ports.size(), n);
    group_ports_ = {ports[0], ports[1]};
    router_port_ = ports[2];
    group_metrics_ports_ = group_metrics ? std::vector<int>{ports[3], ports[4]}
                                         : std::vector<int>{0, 0};
    cluster_file_ = dir_.path() + "/cluster.textproto";
    test_util::WriteTextFile(cluster_file_,
                             SmallCluster(ports[0], ports[1], ports[2], group_metrics_ports_[0],
                                          group_metrics_ports_[1], threads, router_extra_) +
                                 cluster_extra_);
    log_dir_ = dir_.path() + "/logs";
    std::vector<std::string> args = {HIMOE_CLUSTER_BINARY, "--cluster=" + cluster_file_,
                                     "--log_dir=" + log_dir_,
                                     absl::StrCat("--ready_timeout_s=", kReadyTimeoutFlagS)};
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_TRUE(launcher.Start(args, dir_.path() + "/stdout.txt", dir_.path() + "/stderr.txt"));
    const bool ready = launcher.WaitForStdout("himoe-cluster: ready", kReadyBound);
    // The pid files exist from the spawn on: register them even on failure.
    for (const char* name : {"expert-0.pid", "expert-1.pid", "router.pid"}) {
      launcher.AddServicePid(ReadPid(log_dir_ + "/" + name));
    }
    ASSERT_TRUE(ready) << "no ready line from himoe-cluster\n" << launcher.Output();
    expert_pids_ = {ReadPid(log_dir_ + "/expert-0.pid"), ReadPid(log_dir_ + "/expert-1.pid")};
    router_pid_ = ReadPid(log_dir_ + "/router.pid");
    for (pid_t pid : {expert_pids_[0], expert_pids_[1], router_pid_}) {
      ASSERT_GT(pid, 0) << launcher.Output();
      ASSERT_EQ(kill(pid, 0), 0) << "pid " << pid << " is not running";
      // The table names every service's pid.
      EXPECT_THAT(launcher.Stdout(), HasSubstr(absl::StrCat(" ", pid, " ")));
    }
  }

  // One RouteForward of 5 tokens to layer 0 of the cluster's router.
  void RouteFiveTokens(LauncherProcess& launcher) {
    auto router = v1::RouterService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", router_port_), grpc::InsecureChannelCredentials()));
    const at::Tensor hidden = at::randn({5, 16});
    v1::RouteForwardRequest request;
    request.set_layer(0);
    ASSERT_TRUE(EncodeTensor(hidden, request.mutable_hidden()).ok());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RouteForwardResponse response;
    const grpc::Status status = router->RouteForward(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message() << "\n" << launcher.Output();
    absl::StatusOr<at::Tensor> output = DecodeTensor(response.output(), "output");
    ASSERT_TRUE(output.ok()) << output.status();
    EXPECT_EQ(output->sizes(), (std::vector<int64_t>{5, 16}));
    EXPECT_EQ(output->scalar_type(), at::kFloat);
    EXPECT_TRUE(at::isfinite(*output).all().item<bool>());
    EXPECT_GT(output->abs().sum().item<float>(), 0.0f);
  }

  test_util::TempDir dir_{"himoe_launcher_test"};
  std::string cluster_extra_;  // appended to the cluster file
  std::string router_extra_;   // inside its router { }
  std::string cluster_file_, log_dir_;
  std::vector<int> group_ports_;
  std::vector<int> group_metrics_ports_;
  int router_port_ = 0;
  std::vector<pid_t> expert_pids_;
  pid_t router_pid_ = -1;
};

TEST_F(LauncherTest, StartsServesAndStopsOnSigint) {
  LauncherProcess launcher;
  ASSERT_NO_FATAL_FAILURE(StartSmallCluster(launcher));

  // The logs are where the table says, each headed by its command line: the
  // launcher found the binaries of this build tree by itself.
  const std::string expert_log = test_util::ReadTextFile(log_dir_ + "/expert-0.log");
  EXPECT_THAT(expert_log, HasSubstr(CanonicalPath(HIMOE_EXPERT_BINARY).value_or("?")));
  EXPECT_THAT(expert_log, HasSubstr("--group_id=0"));
  EXPECT_THAT(expert_log, HasSubstr("--threads=1 "));  // as the cluster file says
  // --address is host:port on every binary; the expert has no --port flag.
  EXPECT_THAT(expert_log, HasSubstr(absl::StrCat("--address=127.0.0.1:", group_ports_[0], " ")));
  EXPECT_THAT(expert_log, Not(HasSubstr("--port=")));
  EXPECT_THAT(test_util::ReadTextFile(log_dir_ + "/router.log"),
              HasSubstr(CanonicalPath(HIMOE_ROUTER_BINARY).value_or("?")));
  EXPECT_THAT(launcher.Stdout(), HasSubstr(log_dir_ + "/expert-1.log"));
  EXPECT_THAT(launcher.Stdout(), HasSubstr(absl::StrCat("127.0.0.1:", router_port_)));
  EXPECT_THAT(launcher.Stdout(), HasSubstr("/metrics"));  // the router's
  {
    std::ifstream in(log_dir_ + "/router.port");
    int port = 0;
    ASSERT_TRUE(in >> port);
    EXPECT_EQ(port, router_port_);
  }

  ASSERT_NO_FATAL_FAILURE(RouteFiveTokens(launcher));
  for (int g = 0; g < 2; ++g) {
    auto expert = v1::ExpertService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", group_ports_[g]), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ExpertInfoResponse info;
    const grpc::Status status = expert->Info(&context, v1::ExpertInfoRequest(), &info);
    ASSERT_TRUE(status.ok()) << "group " << g << ": " << status.error_message();
    EXPECT_EQ(info.group_id(), g);
    EXPECT_EQ(info.num_groups(), 2);
    EXPECT_THAT(info.expert_ids(), ::testing::ElementsAre(2 * g, 2 * g + 1));
  }
  // (Client channels are gone here, so no service waits on an idle client.)

  ASSERT_EQ(kill(launcher.pid(), SIGINT), 0);
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit after SIGINT\n"
                                  << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << launcher.Output();
  for (pid_t pid : {expert_pids_[0], expert_pids_[1], router_pid_}) {
    EXPECT_TRUE(WaitGone(pid, std::chrono::seconds(10))) << "pid " << pid << " is still there";
  }
  EXPECT_TRUE(test_util::NoChildLeft());
  EXPECT_THAT(launcher.Stdout(), HasSubstr("himoe-cluster: stopped"));
  // Nothing was killed for being slow to stop.
  EXPECT_THAT(launcher.Stderr(), Not(HasSubstr("SIGKILL")));
}

// A cluster file's tls with roles: every group and the router serve mutual
// TLS only, the launcher's readiness probes and the router's group calls use
// it (the router with its role's certificate), the groups answer training
// only to the trainer's, and its paths are relative to the file's folder
// (the launcher runs elsewhere).
TEST_F(LauncherTest, ServesMutualTlsOnEveryPortFromTheClusterFile) {
  const std::string certs = dir_.path() + "/certs";
  const std::string command = absl::StrCat(
      "bash ", HIMOE_SOURCE_DIR, "/tests/router_service/make_test_certs.sh ", certs);
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  cluster_extra_ = R"(tls { ca: "certs/ca.pem" cert: "certs/expert.pem" key: "certs/expert.key"
  trainer { cert: "certs/trainer.pem" key: "certs/trainer.key" identity: "spiffe://himoe/trainer" }
  router { cert: "certs/router.pem" key: "certs/router.key" identity: "spiffe://himoe/router" } })";
  LauncherProcess launcher;
  ASSERT_NO_FATAL_FAILURE(StartSmallCluster(launcher));
  const std::string expert_log = test_util::ReadTextFile(log_dir_ + "/expert-1.log");
  EXPECT_THAT(expert_log, HasSubstr(absl::StrCat("--tls_ca=", certs, "/ca.pem")));
  EXPECT_THAT(expert_log, HasSubstr("--trainer_identity=spiffe://himoe/trainer"));
  EXPECT_THAT(expert_log, HasSubstr("--router_identity=spiffe://himoe/router"));

  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> client = MakeChannelCredentials(
      TlsFiles{certs + "/ca.pem", certs + "/client.pem", certs + "/client.key"});
  ASSERT_TRUE(client.ok()) << client.status();
  const auto route = [&](const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                         at::Tensor* output) {
    auto router = v1::RouterService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_port_), credentials));
    v1::RouteForwardRequest request;
    request.set_layer(0);
    EXPECT_TRUE(EncodeTensor(at::randn({5, 16}), request.mutable_hidden()).ok());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RouteForwardResponse response;
    const grpc::Status status = router->RouteForward(&context, request, &response);
    if (status.ok()) *output = DecodeTensor(response.output(), "output").value();
    return status;
  };
  at::Tensor output;
  const grpc::Status tls = route(*client, &output);
  ASSERT_TRUE(tls.ok()) << tls.error_message() << "\n" << launcher.Output();
  EXPECT_EQ(output.sizes(), (std::vector<int64_t>{5, 16}));
  EXPECT_TRUE(at::isfinite(output).all().item<bool>());
  EXPECT_GT(output.abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(route(grpc::InsecureChannelCredentials(), &output).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  {
    auto expert = v1::ExpertService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", group_ports_[0]), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ExpertInfoResponse info;
    EXPECT_EQ(expert->Info(&context, v1::ExpertInfoRequest(), &info).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  {
    // A certificate of the CA without the trainer's role may not train.
    auto expert = v1::ExpertService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", group_ports_[0]), *client));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::BeginRunRequest begin;
    begin.set_run_id("intruder");
    v1::BeginRunResponse begun;
    const grpc::Status refused = expert->BeginRun(&context, begin, &begun);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
  }

  ASSERT_EQ(kill(launcher.pid(), SIGINT), 0);
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << launcher.Output();
  EXPECT_TRUE(test_util::NoChildLeft());
}

// threads: 0 is a share of the host, not every core for every service: the
// 2 groups and the router each get max(1, cores / 3); an explicit count is
// passed as it is (StartsServesAndStopsOnSigint's threads: 1).
TEST_F(LauncherTest, ThreadsZeroSharesTheHostsCoresAmongItsServices) {
  LauncherProcess launcher;
  ASSERT_NO_FATAL_FAILURE(StartSmallCluster(launcher, {}, false, /*threads=*/0));
  const std::string share = absl::StrCat("--threads=", std::max(1, DefaultThreadCount() / 3), " ");
  EXPECT_THAT(test_util::ReadTextFile(log_dir_ + "/expert-0.log"), HasSubstr(share));
  EXPECT_THAT(test_util::ReadTextFile(log_dir_ + "/expert-1.log"), HasSubstr(share));
  EXPECT_THAT(test_util::ReadTextFile(log_dir_ + "/router.log"), HasSubstr(share));
  ASSERT_EQ(kill(launcher.pid(), SIGINT), 0);
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << launcher.Output();
  EXPECT_EQ(WEXITSTATUS(*status), 0) << launcher.Output();
}

// The POSIX shared-memory objects process `pid` made (SharedMemoryRegion
// names them "/himoe-<pid>-...").
int SharedMemoryObjectsOf(pid_t pid) {
  const std::string prefix = absl::StrCat("himoe-", pid, "-");
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (std::string(entry->d_name).rfind(prefix, 0) == 0) ++count;
  }
  closedir(dir);
  return count;
}

// router.shared_memory: the groups are started with --shared_memory, the
// router's rows reach them through regions of its own (one per group that
// got rows), and the regions go with the router.
TEST_F(LauncherTest, RouterSharedMemoryStartsTheGroupsWithIt) {
  router_extra_ = "shared_memory: true";
  LauncherProcess launcher;
  ASSERT_NO_FATAL_FAILURE(StartSmallCluster(launcher));
  for (int g = 0; g < 2; ++g) {
    EXPECT_THAT(test_util::ReadTextFile(absl::StrCat(log_dir_, "/expert-", g, ".log")),
                HasSubstr("--shared_memory"));
  }
  EXPECT_EQ(SharedMemoryObjectsOf(router_pid_), 0);
  ASSERT_NO_FATAL_FAILURE(RouteFiveTokens(launcher));
  // k = 1 in each of the 2 groups: every token went to both.
  EXPECT_EQ(SharedMemoryObjectsOf(router_pid_), 2);

  ASSERT_EQ(kill(launcher.pid(), SIGINT), 0);
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit after SIGINT\n"
                                  << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << launcher.Output();
  EXPECT_TRUE(WaitGone(router_pid_, std::chrono::seconds(10)));
  EXPECT_EQ(SharedMemoryObjectsOf(router_pid_), 0);
  EXPECT_TRUE(test_util::NoChildLeft());
}

// A router killed while it holds regions cannot unlink them: the launcher,
// stopping the cluster, removes what it left in /dev/shm.
TEST_F(LauncherTest, ARouterKilledLeavesNoSharedMemoryBehind) {
  router_extra_ = "shared_memory: true";
  LauncherProcess launcher;
  ASSERT_NO_FATAL_FAILURE(StartSmallCluster(launcher));
  ASSERT_NO_FATAL_FAILURE(RouteFiveTokens(launcher));
  ASSERT_EQ(SharedMemoryObjectsOf(router_pid_), 2);

  ASSERT_EQ(kill(router_pid_, SIGKILL), 0);
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit after the router died\n"
                                  << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << launcher.Output();
  EXPECT_THAT(launcher.Stderr(), HasSubstr("killed by signal 9"));
  EXPECT_EQ(SharedMemoryObjectsOf(router_pid_), 0) << launcher.Output();
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LauncherTest, StopsEverythingAndFailsWhenAServiceDies) {
  LauncherProcess launcher;
  // Also: --bin_dir given as the build tree root.
  ASSERT_NO_FATAL_FAILURE(StartSmallCluster(launcher, {"--bin_dir=" + BuildRoot()}));

  ASSERT_EQ(kill(expert_pids_[1], SIGKILL), 0);
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit after a service died\n"
                                  << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 1) << launcher.Output();
  EXPECT_THAT(launcher.Stderr(), HasSubstr("expert group 1"));
  EXPECT_THAT(launcher.Stderr(), HasSubstr("killed by signal 9"));
  for (pid_t pid : {expert_pids_[0], expert_pids_[1], router_pid_}) {
    EXPECT_TRUE(WaitGone(pid, std::chrono::seconds(10))) << "pid " << pid << " is still there";
  }
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LauncherTest, ServesEachGroupsMetricsWhenConfigured) {
  LauncherProcess launcher;
  ASSERT_NO_FATAL_FAILURE(StartSmallCluster(launcher, {}, /*group_metrics=*/true));
  for (int g = 0; g < 2; ++g) {
    SCOPED_TRACE(absl::StrCat("group ", g));
    const std::string url =
        absl::StrCat("http://127.0.0.1:", group_metrics_ports_[g], "/metrics");
    // The table shows the URL; the expert got the port, on the group's interface.
    EXPECT_THAT(launcher.Stdout(), HasSubstr(url));
    const std::string log = test_util::ReadTextFile(absl::StrCat(log_dir_, "/expert-", g, ".log"));
    EXPECT_THAT(log, HasSubstr(absl::StrCat("--metrics_port=", group_metrics_ports_[g])));
    EXPECT_THAT(log, HasSubstr("--metrics_address=127.0.0.1"));
    absl::StatusOr<std::string> body = testutil::HttpGet(url);
    ASSERT_TRUE(body.ok()) << body.status();
    EXPECT_THAT(*body, HasSubstr("himoe_expert_forward_requests_total"));
  }

  ASSERT_EQ(kill(launcher.pid(), SIGINT), 0);
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit after SIGINT\n"
                                  << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << launcher.Output();
  for (pid_t pid : {expert_pids_[0], expert_pids_[1], router_pid_}) {
    EXPECT_TRUE(WaitGone(pid, std::chrono::seconds(10))) << "pid " << pid << " is still there";
  }
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LauncherTest, ReportsAServiceThatExitsEarly) {
  // Group 0's port is taken (a listening socket without SO_REUSEPORT, so the
  // expert's gRPC server cannot bind it): that expert exits at once.
  const std::vector<int> ports = test_util::FreeLoopbackPorts(3);
  ASSERT_EQ(ports.size(), 3u);
  const int blocker = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(blocker, 0);
  struct CloseGuard {
    int fd;
    ~CloseGuard() { close(fd); }
  } close_guard{blocker};
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(ports[0]);
  ASSERT_EQ(bind(blocker, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(blocker, 1), 0);

  const std::string cluster = dir_.path() + "/cluster.textproto";
  test_util::WriteTextFile(cluster, SmallCluster(ports[0], ports[1], ports[2]));
  const std::string log_dir = dir_.path() + "/logs";
  LauncherProcess launcher;
  ASSERT_TRUE(launcher.Start({HIMOE_CLUSTER_BINARY, "--cluster=" + cluster, "--log_dir=" + log_dir,
                              absl::StrCat("--ready_timeout_s=", kReadyTimeoutFlagS)},
                             dir_.path() + "/stdout.txt", dir_.path() + "/stderr.txt"));
  for (const char* name : {"expert-0.pid", "expert-1.pid", "router.pid"}) {
    launcher.AddServicePid(ReadPid(log_dir + "/" + name));
  }
  const std::optional<int> status = launcher.WaitExit(kReadyBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit\n" << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 1) << launcher.Output();
  EXPECT_THAT(launcher.Stderr(), HasSubstr("expert group 0"));
  EXPECT_THAT(launcher.Stderr(), HasSubstr("exited with code"));
  // The tail of its log, which starts with its command line.
  EXPECT_THAT(launcher.Stderr(), HasSubstr("    | # "));
  EXPECT_THAT(launcher.Stdout(), Not(HasSubstr("ready")));
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LauncherTest, ReportsAServiceThatNeverGetsReady) {
  // Stand-in binaries that start, print a line and never serve.
  const std::string bin_dir = dir_.path() + "/bin";
  ASSERT_EQ(mkdir(bin_dir.c_str(), 0755), 0);
  for (const char* name : {"himoe-expert", "himoe-router"}) {
    const std::string path = bin_dir + "/" + name;
    test_util::WriteTextFile(
        path, absl::StrCat("#!/bin/sh\necho fake ", name, " starting\nexec sleep 600\n"));
    ASSERT_EQ(chmod(path.c_str(), 0755), 0);
  }
  const std::vector<int> ports = test_util::FreeLoopbackPorts(3);
  ASSERT_EQ(ports.size(), 3u);
  const std::string cluster = dir_.path() + "/cluster.textproto";
  test_util::WriteTextFile(cluster, SmallCluster(ports[0], ports[1], ports[2]));
  const std::string log_dir = dir_.path() + "/logs";
  LauncherProcess launcher;
  ASSERT_TRUE(launcher.Start({HIMOE_CLUSTER_BINARY, "--cluster=" + cluster, "--log_dir=" + log_dir,
                              "--bin_dir=" + bin_dir, "--ready_timeout_s=2"},
                             dir_.path() + "/stdout.txt", dir_.path() + "/stderr.txt"));
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit\n" << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 1) << launcher.Output();
  EXPECT_THAT(launcher.Stderr(), HasSubstr("expert group 0 at 127.0.0.1:"));
  EXPECT_THAT(launcher.Stderr(), HasSubstr("is not ready after 2 s"));
  EXPECT_THAT(launcher.Stderr(), HasSubstr("fake himoe-expert starting"));
  // The router is only started once the groups are ready.
  EXPECT_FALSE(test_util::PathExists(log_dir + "/router.log"));
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LauncherTest, HelpListsItsOwnFlags) {
  const std::string log_dir = dir_.path() + "/logs";
  LauncherProcess launcher;
  ASSERT_TRUE(launcher.Start({HIMOE_CLUSTER_BINARY, "--help", "--log_dir=" + log_dir},
                             dir_.path() + "/stdout.txt", dir_.path() + "/stderr.txt"));
  const std::optional<int> status = launcher.WaitExit(kExitBound);
  ASSERT_TRUE(status.has_value()) << "himoe-cluster --help did not exit\n" << launcher.Output();
  EXPECT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
  const std::string help = launcher.Output();
  EXPECT_THAT(help, HasSubstr("Starts every expert group of a cluster file"));
  for (const char* flag : {"--cluster", "--bin_dir", "--log_dir", "--ready_timeout_s"}) {
    EXPECT_THAT(help, HasSubstr(flag)) << help;
  }
  EXPECT_THAT(help, Not(HasSubstr("No flags matched")));
  EXPECT_FALSE(test_util::PathExists(log_dir));
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LauncherTest, RefusesBadInputWithoutStartingAnything) {
  struct Case {
    std::string name;
    std::string cluster;                 // file contents; empty = no --cluster flag
    std::vector<std::string> extra;      // more flags
    std::vector<std::string> messages;   // expected on stderr
  };
  const std::string good = SmallCluster(50991, 50992, 50990);
  const std::vector<Case> cases = {
      {"num_groups mismatch",
       R"(model { d_model: 16 d_ff: 32 num_experts: 4 num_groups: 3 }
groups { address: "127.0.0.1:50991" }
groups { address: "127.0.0.1:50992" }
router { address: "127.0.0.1:50990" })",
       {},
       {"model.num_groups is 3 but 2 groups are listed"}},
      {"remote group",
       R"(model { d_model: 16 d_ff: 32 num_experts: 4 num_groups: 2 }
groups { address: "127.0.0.1:50991" }
groups { address: "10.1.2.3:5000" }
router { address: "127.0.0.1:50990" })",
       {},
       {"groups[1].address is 10.1.2.3:5000", "Start himoe-expert on that machine"}},
      {"remote router",
       R"(model { d_model: 16 d_ff: 32 num_experts: 4 num_groups: 1 }
groups { address: "localhost:50991" }
router { address: "10.1.2.3:50990" })",
       {},
       {"router.address is 10.1.2.3:50990", "Start himoe-router on that machine"}},
      {"syntax error",
       "model {\n  d_model: 16\n  d_ff: = 32\n}\n",
       {},
       {"not a valid ClusterConfig text proto", "line 3"}},
      {"duplicate port",
       R"(model { d_model: 16 d_ff: 32 num_experts: 4 num_groups: 2 }
groups { address: "127.0.0.1:50991" }
groups { address: "0.0.0.0:50991" }
router { address: "127.0.0.1:50990" })",
       {},
       {"groups[1].address uses port 50991, which groups[0].address uses too"}},
      {"group metrics port used twice",
       R"(model { d_model: 16 d_ff: 32 num_experts: 4 num_groups: 2 }
groups { address: "127.0.0.1:50991" metrics_port: 50995 }
groups { address: "127.0.0.1:50992" metrics_port: 50995 }
router { address: "127.0.0.1:50990" })",
       {},
       {"groups[1].metrics_port uses port 50995, which groups[0].metrics_port uses too"}},
      {"group metrics port out of range",
       R"(model { d_model: 16 d_ff: 32 num_experts: 4 num_groups: 1 }
groups { address: "127.0.0.1:50991" metrics_port: 70000 }
router { address: "127.0.0.1:50990" })",
       {},
       {"groups[0].metrics_port 70000 is out of range"}},
      {"tls without a key", good + R"(tls { ca: "ca.pem" cert: "server.pem" })",
       {},
       {"tls: ca, cert and key are all needed"}},
      {"tls role without identity",
       good + R"(tls { ca: "ca.pem" cert: "server.pem" key: "server.key"
                       trainer { cert: "t.pem" key: "t.key" } })",
       {},
       {"tls.trainer: cert, key and identity are all needed"}},
      {"router role without a trainer",
       good + R"(tls { ca: "ca.pem" cert: "server.pem" key: "server.key"
                       router { cert: "r.pem" key: "r.key" identity: "spiffe://himoe/router" } })",
       {},
       {"tls.router: roles need tls.trainer too"}},
      {"tls file missing",
       good + R"(tls { ca: "no-ca.pem" cert: "no-server.pem" key: "no-server.key" })",
       {},
       {"tls: tls ca_file: cannot read ", "/no-ca.pem"}},
      {"missing file", "", {"--cluster=/nonexistent/cluster.textproto"}, {"cannot open"}},
      {"no --cluster", "", {}, {"--cluster FILE is required"}},
      {"positional argument", "", {"cluster.textproto"},
       {"unexpected argument 'cluster.textproto'"}},
      {"binaries not found", good, {"--bin_dir=/nonexistent"}, {"cannot find the himoe-expert"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.name);
    std::vector<std::string> args = {HIMOE_CLUSTER_BINARY};
    if (!c.cluster.empty()) {
      const std::string file = absl::StrCat(dir_.path(), "/bad-", i, ".textproto");
      test_util::WriteTextFile(file, c.cluster);
      args.push_back("--cluster=" + file);
    }
    const std::string log_dir = absl::StrCat(dir_.path(), "/logs-", i);
    args.push_back("--log_dir=" + log_dir);
    args.insert(args.end(), c.extra.begin(), c.extra.end());

    LauncherProcess launcher;
    ASSERT_TRUE(launcher.Start(args, absl::StrCat(dir_.path(), "/out-", i, ".txt"),
                               absl::StrCat(dir_.path(), "/err-", i, ".txt")));
    const std::optional<int> status = launcher.WaitExit(kExitBound);
    ASSERT_TRUE(status.has_value()) << "himoe-cluster did not exit\n" << launcher.Output();
    EXPECT_TRUE(WIFEXITED(*status)) << "wait status " << *status;
    EXPECT_NE(WEXITSTATUS(*status), 0);
    for (const std::string& m : c.messages) {
      EXPECT_THAT(launcher.Stderr(), HasSubstr(m)) << launcher.Output();
    }
    EXPECT_THAT(launcher.Stdout(), Not(HasSubstr("ready")));
    // Nothing started: no log directory, no process left behind.
    EXPECT_FALSE(test_util::PathExists(log_dir));
    EXPECT_TRUE(test_util::NoChildLeft());
  }
}

}  // namespace
}  // namespace himoe
