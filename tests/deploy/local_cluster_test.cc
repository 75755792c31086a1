// LocalExpertCluster (deploy/local/local_cluster.h) with the real himoe-expert:
// start, answer Info, stop (explicitly, twice, by destruction), report a dead
// group, refuse a bad binary, and take the experts down with a dead parent;
// the Info shape handshake; and ServiceSet (deploy/local/process_set.h) with
// stand-in shell services.
//
// This process makes itself a child subreaper, so that experts orphaned by a
// dead parent (the death test) are re-parented here and can be reaped; every
// test checks that it leaves no child behind.

#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/tls_files.h"
#include "deploy/local/local_cluster.h"
#include "deploy/local/process_set.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "tests/deploy/child_checks.h"
#include "tests/http_get.h"
#include "tests/temp_dir.h"

namespace himoe::local {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using Clock = std::chrono::steady_clock;

// Generous bounds: a hung process fails the test instead of hanging it.
constexpr auto kReadyTimeout = std::chrono::seconds(120);
constexpr auto kGoneBound = std::chrono::seconds(60);

// Kills and reaps every child of this process (subreaper: orphaned experts
// included). A safety net for failing tests; returns how many there were.
int KillAllChildren() {
  int n = 0;
  for (int round = 0; round < 1000; ++round) {
    int status = 0;
    const pid_t any = waitpid(-1, &status, WNOHANG);
    if (any > 0) {
      ++n;
      continue;
    }
    if (any < 0) return n;  // ECHILD: none left
    // Children are running: find them in /proc (their parent is us).
    bool found = false;
    for (const std::string& name : ListDirectory("/proc").value_or(std::vector<std::string>{})) {
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat_file("/proc/" + name + "/stat");
      std::string line;
      std::getline(stat_file, line);
      const size_t close = line.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(line.substr(close + 2));
      char state = 0;
      pid_t ppid = 0;
      rest >> state >> ppid;
      if (ppid == getpid()) {
        const pid_t pid = std::stoi(name);
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        ++n;
        found = true;
      }
    }
    if (!found) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return n + 1000;  // gave up (some child could not be found or reaped)
}

// A tiny model: 2 groups x 2 experts, 1 layer, d_model 16.
ExpertProcessOptions TinyOptions(const std::string& log_dir) {
  ExpertProcessOptions o;
  o.binary = HIMOE_EXPERT_BINARY;
  o.shape.set_num_groups(2);
  o.shape.set_num_experts(4);
  o.shape.set_num_layers(1);
  o.shape.set_d_model(16);
  o.shape.set_d_ff(32);
  o.shape.set_seed(3);
  o.shape.set_dtype(v1::DTYPE_FLOAT32);
  o.threads = 1;
  o.log_dir = log_dir;
  o.ready_timeout = kReadyTimeout;
  return o;
}

// Info of the himoe-expert at `address`.
grpc::Status Info(const std::string& address, v1::ExpertInfoResponse* info) {
  auto stub = v1::ExpertService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return stub->Info(&context, v1::ExpertInfoRequest(), info);
}

// A subreaper with a fresh directory that checks it leaves no child behind.
class ChildrenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    ASSERT_FALSE(dir_.path().empty());
  }
  void TearDown() override { EXPECT_EQ(KillAllChildren(), 0) << "children were left behind"; }

  test_util::TempDir dir_{"himoe_local_cluster_test"};
};

class LocalExpertClusterTest : public ChildrenTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(ChildrenTest::SetUp());
    ASSERT_TRUE(test_util::PathExists(HIMOE_EXPERT_BINARY));
  }
};

TEST_F(LocalExpertClusterTest, StartsAnswersInfoAndStops) {
  const std::string log_dir = dir_.path() + "/logs";
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started =
      LocalExpertCluster::Start(TinyOptions(log_dir));
  ASSERT_TRUE(started.ok()) << started.status();
  LocalExpertCluster& cluster = **started;

  EXPECT_EQ(cluster.log_dir(), CanonicalPath(log_dir).value_or("?"));
  ASSERT_EQ(cluster.addresses().size(), 2u);
  ASSERT_EQ(cluster.pids().size(), 2u);
  for (int g = 0; g < 2; ++g) {
    SCOPED_TRACE(absl::StrCat("group ", g));
    EXPECT_THAT(cluster.addresses()[g], StartsWith("127.0.0.1:"));
    EXPECT_NE(cluster.addresses()[g], "127.0.0.1:0");
    v1::ExpertInfoResponse info;
    const grpc::Status status = Info(cluster.addresses()[g], &info);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(info.group_id(), g);
    EXPECT_EQ(info.num_groups(), 2);
    EXPECT_EQ(info.d_model(), 16);
    EXPECT_THAT(info.expert_ids(), ::testing::ElementsAre(2 * g, 2 * g + 1));
    EXPECT_GT(cluster.pids()[g], 0);
    EXPECT_EQ(kill(cluster.pids()[g], 0), 0) << "pid " << cluster.pids()[g] << " is not running";
    // Each log is headed by its command line.
    const std::string log = test_util::ReadTextFile(absl::StrCat(log_dir, "/expert-", g, ".log"));
    EXPECT_THAT(log, StartsWith("# "));
    EXPECT_THAT(log, HasSubstr(absl::StrCat("--group_id=", g)));
    EXPECT_THAT(log, HasSubstr("--address=127.0.0.1:0 "));
    EXPECT_THAT(log, Not(HasSubstr("--port=")));
    EXPECT_THAT(log, HasSubstr("--seed=3 --dtype=float32 "));
    EXPECT_TRUE(test_util::PathExists(absl::StrCat(log_dir, "/expert-", g, ".pid")));
  }
  EXPECT_NE(cluster.addresses()[0], cluster.addresses()[1]);
  EXPECT_TRUE(cluster.CheckAlive().ok()) << cluster.CheckAlive();

  const std::vector<int> pids = cluster.pids();
  cluster.Stop();
  for (int pid : pids) {
    // Stopped and reaped: no zombie left either.
    EXPECT_TRUE(test_util::ProcessGone(pid)) << "pid " << pid << " is still there";
  }
  EXPECT_TRUE(test_util::NoChildLeft());
  EXPECT_FALSE(test_util::PathExists(log_dir + "/expert-0.pid"));
  EXPECT_FALSE(test_util::PathExists(log_dir + "/expert-0.port"));
  EXPECT_TRUE(test_util::PathExists(log_dir + "/expert-0.log"));  // the logs stay

  cluster.Stop();  // a no-op
  EXPECT_EQ(cluster.pids(), pids);
  EXPECT_EQ(cluster.CheckAlive().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LocalExpertClusterTest, InfoHandshakeRefusesAnotherShapeOrGroup) {
  const ExpertProcessOptions options = TinyOptions(dir_.path() + "/logs");
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started = LocalExpertCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  absl::StatusOr<std::shared_ptr<grpc::Channel>> probe = ProbeChannel((*started)->addresses()[1]);
  ASSERT_TRUE(probe.ok()) << probe.status();
  const std::shared_ptr<grpc::Channel> channel = *probe;

  EXPECT_TRUE(ProbeExpertInfo(channel, 1, options.shape).ok());

  v1::ExpertShape other = options.shape;
  other.set_seed(4);
  other.set_dtype(v1::DTYPE_BFLOAT16);
  const absl::Status shape = ProbeExpertInfo(channel, 1, other);
  EXPECT_EQ(shape.code(), absl::StatusCode::kFailedPrecondition) << shape;
  EXPECT_THAT(shape.message(), HasSubstr("group 1 serves seed 3, dtype float32"));
  EXPECT_THAT(shape.message(), HasSubstr("needs seed 4, dtype bfloat16"));
  EXPECT_THAT(shape.message(), Not(HasSubstr("d_model")));

  const absl::Status group = ProbeExpertInfo(channel, 0, options.shape);
  EXPECT_EQ(group.code(), absl::StatusCode::kFailedPrecondition) << group;
  EXPECT_THAT(group.message(), HasSubstr("Info answered group 1 (expected group 0)"));
  EXPECT_THAT(group.message(), HasSubstr("another service holds this port"));

  (*started)->Stop();
  EXPECT_EQ(ProbeExpertInfo(channel, 1, options.shape).code(), absl::StatusCode::kUnavailable);
}

TEST_F(LocalExpertClusterTest, ServesEachGroupsMetricsWhenAsked) {
  ExpertProcessOptions options = TinyOptions(dir_.path() + "/logs");
  options.metrics_port_base = 0;  // ports they pick, read back from the port files
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started = LocalExpertCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalExpertCluster& cluster = **started;
  ASSERT_EQ(cluster.metrics_addresses().size(), 2u);
  for (int g = 0; g < 2; ++g) {
    SCOPED_TRACE(absl::StrCat("group ", g));
    EXPECT_THAT(cluster.metrics_addresses()[g], StartsWith("127.0.0.1:"));
    EXPECT_NE(cluster.metrics_addresses()[g], "127.0.0.1:0");
    absl::StatusOr<std::string> body =
        testutil::HttpGet(absl::StrCat("http://", cluster.metrics_addresses()[g], "/metrics"));
    ASSERT_TRUE(body.ok()) << body.status();
    EXPECT_THAT(*body, HasSubstr(absl::StrCat("himoe_expert_forward_requests_total{group=\"", g,
                                              "\"} 0")));
  }
  cluster.Stop();
  EXPECT_TRUE(test_util::NoChildLeft());

  // Off by default.
  started = LocalExpertCluster::Start(TinyOptions(dir_.path() + "/logs2"));
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_TRUE((*started)->metrics_addresses().empty());
}

TEST_F(LocalExpertClusterTest, FindsTheBinaryByItselfAndStopsWhenDestroyed) {
  // No binary given: found in the build tree around this test
  // (<build>/tests/deploy/ -> <build>/expert_service/); no log directory
  // given: a fresh one under /tmp.
  ExpertProcessOptions options = TinyOptions("");
  options.binary.clear();
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started = LocalExpertCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<LocalExpertCluster> cluster = *std::move(started);
  const std::string log_dir = cluster->log_dir();
  EXPECT_THAT(log_dir, StartsWith("/tmp/himoe-experts-"));
  EXPECT_THAT(test_util::ReadTextFile(log_dir + "/expert-0.log"),
              StartsWith(absl::StrCat(
                  "# ", CanonicalPath(HIMOE_EXPERT_BINARY).value_or("?"), " ")));
  const std::vector<int> pids = cluster->pids();
  ASSERT_EQ(pids.size(), 2u);
  for (int pid : pids) EXPECT_EQ(kill(pid, 0), 0);

  cluster.reset();
  for (int pid : pids)
    EXPECT_TRUE(test_util::ProcessGone(pid)) << "pid " << pid << " is still there";
  EXPECT_TRUE(test_util::NoChildLeft());
  (void)RemoveAll(log_dir);
}

TEST_F(LocalExpertClusterTest, CheckAliveNamesADeadGroup) {
  const std::string log_dir = dir_.path() + "/logs";
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started =
      LocalExpertCluster::Start(TinyOptions(log_dir));
  ASSERT_TRUE(started.ok()) << started.status();
  LocalExpertCluster& cluster = **started;
  ASSERT_TRUE(cluster.CheckAlive().ok());
  const std::vector<int> pids = cluster.pids();

  ASSERT_EQ(kill(pids[1], SIGKILL), 0);
  // The kill is asynchronous: bounded wait until CheckAlive sees it.
  absl::Status alive;
  const auto until = Clock::now() + kGoneBound;
  while ((alive = cluster.CheckAlive()).ok() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(alive.ok()) << "CheckAlive did not notice the dead group";
  EXPECT_THAT(alive.message(), HasSubstr("expert group 1"));
  EXPECT_THAT(alive.message(), Not(HasSubstr("expert group 0")));
  EXPECT_THAT(alive.message(), HasSubstr("killed by signal 9"));
  EXPECT_THAT(alive.message(), HasSubstr(cluster.addresses()[1]));
  // The tail of its log, which starts with its command line.
  EXPECT_THAT(alive.message(), HasSubstr(log_dir + "/expert-1.log"));
  EXPECT_THAT(alive.message(), HasSubstr("    | # "));
  // Asked again, the same answer; the other group still runs.
  EXPECT_EQ(cluster.CheckAlive(), alive);
  EXPECT_EQ(kill(pids[0], 0), 0);

  cluster.Stop();
  for (int pid : pids)
    EXPECT_TRUE(test_util::ProcessGone(pid)) << "pid " << pid << " is still there";
  EXPECT_TRUE(test_util::NoChildLeft());
}

// With TLS files every group serves mutual TLS only, the readiness probes
// dial with them, and a restarted group keeps them.
TEST_F(LocalExpertClusterTest, ServesMutualTlsOnlyWhenGivenCertificates) {
  const std::string certs = dir_.path() + "/certs";
  const std::string command = absl::StrCat(
      "bash ", HIMOE_SOURCE_DIR, "/tests/router_service/make_test_certs.sh ", certs);
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  ExpertProcessOptions options = TinyOptions(dir_.path() + "/logs");
  options.tls = TlsFiles{certs + "/ca.pem", certs + "/server.pem", certs + "/server.key"};
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started = LocalExpertCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalExpertCluster& cluster = **started;
  const TlsFiles client{certs + "/ca.pem", certs + "/client.pem", certs + "/client.key"};
  const auto info = [&](int g, const TlsFiles& tls) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        ProbeChannel(cluster.addresses()[g], tls);
    return channel.ok() ? ProbeExpertInfo(*channel, g, options.shape) : channel.status();
  };
  for (int g = 0; g < 2; ++g) {
    EXPECT_THAT(test_util::ReadTextFile(absl::StrCat(dir_.path(), "/logs/expert-", g, ".log")),
                HasSubstr(absl::StrCat("--tls_ca=", certs, "/ca.pem")));
    EXPECT_TRUE(info(g, client).ok()) << info(g, client);
    EXPECT_EQ(info(g, TlsFiles()).code(), absl::StatusCode::kUnavailable) << "plaintext";
  }
  const int pid = cluster.pids()[1];
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  absl::StatusOr<std::vector<int>> restarted;
  const auto until = Clock::now() + kGoneBound;
  do {
    restarted = cluster.RestartExited();
  } while (restarted.ok() && restarted->empty() && Clock::now() < until);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  EXPECT_THAT(*restarted, ::testing::ElementsAre(1));
  EXPECT_TRUE(info(1, client).ok()) << info(1, client);
  EXPECT_EQ(info(1, TlsFiles()).code(), absl::StatusCode::kUnavailable) << "plaintext";
  cluster.Stop();
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LocalExpertClusterTest, RefusesABadBinaryWithoutStartingAnything) {
  const std::string log_dir = dir_.path() + "/logs";
  ExpertProcessOptions options = TinyOptions(log_dir);
  options.binary = dir_.path() + "/no-such-himoe-expert";
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started = LocalExpertCluster::Start(options);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(started.status().message(), HasSubstr(options.binary));
  EXPECT_THAT(started.status().message(), HasSubstr("not an executable file"));
  EXPECT_FALSE(test_util::PathExists(log_dir));
  EXPECT_TRUE(test_util::NoChildLeft());

  // A directory is not a binary either.
  options.binary = dir_.path();
  started = LocalExpertCluster::Start(options);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(test_util::NoChildLeft());

  // Nothing to start.
  options = TinyOptions(log_dir);
  options.shape.set_num_groups(0);
  started = LocalExpertCluster::Start(options);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(started.status().message(), HasSubstr("num_groups"));
  EXPECT_TRUE(test_util::NoChildLeft());

  // A shape without a dtype is refused, not sent as "DTYPE_UNSPECIFIED".
  options = TinyOptions(log_dir);
  options.shape.clear_dtype();
  started = LocalExpertCluster::Start(options);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(started.status().message(), HasSubstr("dtype"));
  EXPECT_FALSE(test_util::PathExists(log_dir));
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(LocalExpertClusterTest, ReportsAProcessThatExitsAtOnce) {
  // An executable that is not a himoe-expert: it prints a line and fails.
  const std::string fake = dir_.path() + "/fake-expert";
  test_util::WriteTextFile(fake, "#!/bin/sh\necho fake expert refuses \"$2\"\nexit 3\n");
  ASSERT_EQ(chmod(fake.c_str(), 0755), 0);
  const std::string log_dir = dir_.path() + "/logs";
  ExpertProcessOptions options = TinyOptions(log_dir);
  options.binary = fake;
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started = LocalExpertCluster::Start(options);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kUnavailable) << started.status();
  EXPECT_THAT(started.status().message(), HasSubstr("expert group "));
  EXPECT_THAT(started.status().message(), HasSubstr("exited with code 3"));
  EXPECT_THAT(started.status().message(), HasSubstr("fake expert refuses --group_id="));
  EXPECT_TRUE(test_util::NoChildLeft());
  EXPECT_FALSE(test_util::PathExists(log_dir + "/expert-0.pid"));
}

TEST_F(LocalExpertClusterTest, ReportsAProcessThatNeverGetsReady) {
  // Starts, prints a line, never serves (and dies on SIGTERM).
  const std::string fake = dir_.path() + "/fake-expert";
  test_util::WriteTextFile(fake, "#!/bin/sh\necho fake expert starting\nexec sleep 600\n");
  ASSERT_EQ(chmod(fake.c_str(), 0755), 0);
  ExpertProcessOptions options = TinyOptions(dir_.path() + "/logs");
  options.binary = fake;
  options.ready_timeout = std::chrono::seconds(2);
  absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started = LocalExpertCluster::Start(options);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kDeadlineExceeded) << started.status();
  for (const char* group : {"expert group 0", "expert group 1"}) {
    EXPECT_THAT(started.status().message(), HasSubstr(group));
  }
  EXPECT_THAT(started.status().message(), HasSubstr("is not ready after 2 s"));
  EXPECT_THAT(started.status().message(), HasSubstr("no port file yet"));
  EXPECT_THAT(started.status().message(), HasSubstr("fake expert starting"));
  EXPECT_TRUE(test_util::NoChildLeft());
}

// Where the death test's child writes the pids of its experts: named after
// the parent (this test process), which reads it.
std::string PidListPath(pid_t test_pid) {
  return absl::StrCat(::testing::TempDir(), "himoe_local_cluster_orphans_", test_pid);
}

TEST_F(LocalExpertClusterTest, ExpertsDieWithTheirParent) {
  // "threadsafe": the child re-executes this test binary rather than forking
  // a process that has gRPC threads.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string pid_list = PidListPath(getpid());
  struct Cleanup {
    std::string path;
    ~Cleanup() {
      (void)RemoveAll(path);
      (void)RemoveAll(path + ".logs");
    }
  } cleanup{pid_list};

  EXPECT_EXIT(
      {
        // In the child: start the experts, publish their pids, die without
        // stopping them.
        const std::string list = PidListPath(getppid());
        absl::StatusOr<std::unique_ptr<LocalExpertCluster>> started =
            LocalExpertCluster::Start(TinyOptions(list + ".logs"));
        if (!started.ok()) {
          std::fprintf(stderr, "Start failed: %s\n", started.status().ToString().c_str());
          std::_Exit(3);
        }
        test_util::WriteTextFile(list + ".tmp", absl::StrJoin((*started)->pids(), " "));
        std::rename((list + ".tmp").c_str(), list.c_str());
        (void)started->release();
        (void)RemoveAll(dir_.path());  // (this child's fixture never tears down)
        raise(SIGKILL);
      },
      ::testing::KilledBySignal(SIGKILL), "");

  std::vector<pid_t> pids;
  {
    std::ifstream in(pid_list);
    for (pid_t pid; in >> pid;) pids.push_back(pid);
  }
  ASSERT_EQ(pids.size(), 2u) << "the child did not start its experts";
  // They were re-parented to this subreaper: reap them as they end.
  for (pid_t pid : pids) {
    const auto until = Clock::now() + kGoneBound;
    int status = 0;
    pid_t r = 0;
    while ((r = waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(r, pid) << "expert pid " << pid << " outlived its parent";
    if (r == pid) {
      // SIGTERM from PR_SET_PDEATHSIG: the expert shut down by itself.
      EXPECT_TRUE(WIFEXITED(status) || (WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM))
          << "wait status " << status;
    }
  }
  EXPECT_TRUE(test_util::NoChildLeft());
}

// --- ServiceSet with stand-in shell services ----------------------------------

class ServiceSetTest : public ChildrenTest {
 protected:
  // An executable shell script in the test directory.
  std::string Script(const std::string& name, const std::string& body) {
    const std::string path = dir_.path() + "/" + name;
    test_util::WriteTextFile(path, "#!/bin/sh\n" + body);
    EXPECT_EQ(chmod(path.c_str(), 0755), 0);
    return path;
  }

  // A service running `script` with its port file as $1.
  ServiceSpec Spec(const std::string& name, const std::string& script) {
    ServiceSpec spec;
    spec.name = name;
    spec.log_path = absl::StrCat(dir_.path(), "/", name, ".log");
    spec.pid_file = absl::StrCat(dir_.path(), "/", name, ".pid");
    spec.port_file = absl::StrCat(dir_.path(), "/", name, ".port");
    spec.argv = {script, spec.port_file};
    return spec;
  }
};

TEST_F(ServiceSetTest, ReportsAServiceWithoutPortFileWithItsLogTail) {
  ServiceSet set;
  const std::string script = Script("silent", "echo silent service up\nexec sleep 600\n");
  ServiceSpec spec = Spec("silent", script);
  spec.address = "127.0.0.1:50999";
  spec.probe = [](const std::shared_ptr<grpc::Channel>&) { return absl::OkStatus(); };
  // A stale port file from an earlier run does not count as ready.
  test_util::WriteTextFile(spec.port_file, "50999\n");
  ASSERT_TRUE(set.Start(spec).ok());
  EXPECT_FALSE(test_util::PathExists(spec.port_file));

  const absl::Status ready =
      set.WaitUntilReady(Clock::now(), std::chrono::seconds(7), std::chrono::milliseconds(10));
  EXPECT_EQ(ready.code(), absl::StatusCode::kDeadlineExceeded) << ready;
  EXPECT_THAT(ready.message(), HasSubstr("silent at 127.0.0.1:50999 (pid "));
  EXPECT_THAT(ready.message(), HasSubstr("is not ready after 7 s"));
  EXPECT_THAT(ready.message(), HasSubstr("no port file yet"));
  EXPECT_THAT(ready.message(), HasSubstr(spec.log_path));
  EXPECT_THAT(ready.message(), HasSubstr(absl::StrCat("    | # ", script, " ", spec.port_file)));
  EXPECT_FALSE(set[0].ready);

  set.Stop();
  EXPECT_TRUE(set.stopped());
  EXPECT_TRUE(test_util::ProcessGone(set.pids()[0]));
  EXPECT_FALSE(test_util::PathExists(spec.pid_file));
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(ServiceSetTest, ReadsThePortFileProbesWatchesAndStops) {
  ServiceSet set;
  ServiceSpec spec =
      Spec("svc", Script("svc", "echo 4321 5432 > \"$1\"\nexec sleep 600\n"));
  spec.want_metrics_port = true;
  int probes = 0;
  spec.probe = [&probes](const std::shared_ptr<grpc::Channel>& channel) {
    // Not ready on the first probe: the set keeps probing.
    return ++probes < 2 ? absl::UnavailableError("warming up") : absl::OkStatus();
  };
  ASSERT_TRUE(set.Start(spec).ok());
  ASSERT_TRUE(test_util::PathExists(spec.pid_file));
  const absl::Status ready = set.WaitUntilReady(Clock::now() + kReadyTimeout, kReadyTimeout,
                                                std::chrono::milliseconds(10));
  ASSERT_TRUE(ready.ok()) << ready;
  EXPECT_EQ(probes, 2);
  EXPECT_TRUE(set[0].ready);
  ASSERT_TRUE(set[0].ports.has_value());
  EXPECT_EQ(set[0].ports->port, 4321);
  EXPECT_EQ(set[0].ports->metrics_port, 5432);
  EXPECT_EQ(set[0].address, "127.0.0.1:4321");  // none configured: dial_host:port
  EXPECT_TRUE(set.CheckAlive().ok());

  // Ready services are not probed again.
  ASSERT_TRUE(set.WaitUntilReady(Clock::now(), kReadyTimeout, std::chrono::milliseconds(10)).ok());
  EXPECT_EQ(probes, 2);

  const int pid = set.pids()[0];
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  absl::Status alive;
  const auto until = Clock::now() + kGoneBound;
  while ((alive = set.CheckAlive()).ok() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(alive.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(alive.message(),
              HasSubstr(absl::StrCat("svc (pid ", pid, ", 127.0.0.1:4321) was killed by signal 9")));

  set.Stop();
  EXPECT_FALSE(test_util::PathExists(spec.pid_file));
  EXPECT_FALSE(test_util::PathExists(spec.port_file));
  EXPECT_TRUE(test_util::NoChildLeft());
}

TEST_F(ServiceSetTest, KillsWhatIgnoresSigtermAfterTheGrace) {
  ServiceSet set;
  // Each writes its port file once its SIGTERM disposition is in place.
  ASSERT_TRUE(set.Start(Spec("stubborn", Script("stubborn", "trap '' TERM\necho 1 > \"$1\"\n"
                                                            "exec sleep 600\n")))
                  .ok());
  ASSERT_TRUE(
      set.Start(Spec("polite", Script("polite", "echo 2 > \"$1\"\nexec sleep 600\n"))).ok());
  const absl::Status ready = set.WaitUntilReady(Clock::now() + kReadyTimeout, kReadyTimeout,
                                                std::chrono::milliseconds(10));
  ASSERT_TRUE(ready.ok()) << ready;
  std::vector<std::string> killed;
  StopOptions options;
  options.grace = std::chrono::seconds(1);
  options.on_kill = [&killed](const ChildProcess& c) { killed.push_back(c.name()); };
  set.Stop(options);
  EXPECT_EQ(killed, std::vector<std::string>{"stubborn"});
  for (size_t i = 0; i < 2; ++i) ASSERT_TRUE(WIFSIGNALED(set[i].process.wait_status()));
  EXPECT_EQ(WTERMSIG(set[0].process.wait_status()), SIGKILL);
  EXPECT_EQ(WTERMSIG(set[1].process.wait_status()), SIGTERM);
  set.Stop(options);  // a no-op
  EXPECT_EQ(killed.size(), 1u);
  EXPECT_TRUE(test_util::NoChildLeft());
}

}  // namespace
}  // namespace himoe::local
