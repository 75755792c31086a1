// An outside client in another language: tests/router_service/python_client.py
// (grpcio + numpy, stubs generated at run time from proto/) calls a router on
// 127.0.0.1 in front of 4 in-process expert services and compares with
// LocalMoE's output, which this test computes and hands over as serialized
// himoe.v1.Tensor files.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/file_util.h"
#include "common/tensor_codec.h"
#include "expert_service/expert_grpc_service.h"
#include "router_service/router_grpc_service.h"
#include "router_service/routing/local_moe.h"
#include "tests/router_service/expert_cluster_util.h"
#include "tests/router_service/routing/routing_test_util.h"
#include "tests/temp_dir.h"

extern char** environ;

namespace himoe::router {
namespace {

using testing::kD;
using testing::kDff;
using testing::kK;
using testing::kLayers;
using testing::kM;
using testing::kN;
using testing::kSeed;
using testing::Loopback;
using testing::StartExpert;

constexpr int kLayer = 1, kTokens = 48;
constexpr char kPython[] = "/usr/bin/python3";
constexpr auto kChildTimeout = std::chrono::seconds(180);


void WriteTensor(const at::Tensor& t, const std::string& path) {
  v1::Tensor proto;
  ASSERT_TRUE(EncodeTensor(t, &proto).ok());
  std::string bytes;
  ASSERT_TRUE(proto.SerializeToString(&bytes));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

// Runs argv with stdout+stderr into `log`, without PYTHONPATH/PYTHONHOME (so a
// pyenv set-up cannot leak into the system interpreter). Waits at most
// kChildTimeout, then kills the child. Returns the exit code, or -1.
int RunChild(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (entry.rfind("PYTHONPATH=", 0) == 0 || entry.rfind("PYTHONHOME=", 0) == 0) continue;
    env.push_back(*e);
  }
  env.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn(" << argv[0] << "): " << std::strerror(rc);
    return -1;
  }
  const auto deadline = std::chrono::steady_clock::now() + kChildTimeout;
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) {
      ADD_FAILURE() << "waitpid: " << std::strerror(errno);
      return -1;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << argv[0] << " " << (argv.size() > 1 ? argv[1] : "")
                    << " did not finish within " << kChildTimeout.count() << " s; killed";
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!WIFEXITED(status)) {
    ADD_FAILURE() << argv[0] << " ended by signal " << WTERMSIG(status);
    return -1;
  }
  return WEXITSTATUS(status);
}

class PythonClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/himoe_python_client_XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr) << std::strerror(errno);
    dir_ = pattern;
  }
  void TearDown() override {
    router_.reset();  // the router before the experts it calls
    experts_.clear();
    if (!dir_.empty()) (void)RemoveAll(dir_);
  }

  std::string dir_;
  std::vector<std::unique_ptr<expert::ExpertServer>> experts_;
  std::unique_ptr<RouterServer> router_;
};

TEST_F(PythonClientTest, SystemPythonHasGrpcAndNumpy) {
  const std::string log = JoinPath(dir_, "imports.log");
  const int code = RunChild(
      {kPython, "-c", "import grpc, grpc_tools.protoc, google.protobuf, numpy"}, log);
  EXPECT_EQ(code, 0) << kPython
                     << " cannot import grpc/grpc_tools/protobuf/numpy (scripts/setup.sh "
                        "installs python3-grpcio python3-grpc-tools python3-protobuf "
                        "python3-numpy):\n"
                     << test_util::ReadTextFile(log);
}

TEST_F(PythonClientTest, RouteForwardFromPythonMatchesLocalMoE) {
  for (int g = 0; g < kM; ++g) {
    experts_.push_back(StartExpert(g));
    ASSERT_NE(experts_.back(), nullptr);
  }
  RouterServerOptions o;
  o.moe.routing = testing::Config(RoutingMethod::kHiMoe, kN, kM, kK);
  o.moe.shape = testing::Shape();
  for (int g = 0; g < kM; ++g) {
    expert::ExpertGroupClientOptions go;
    go.addresses = {Loopback(experts_[g]->port())};
    go.deadline = std::chrono::milliseconds(5000);
    o.moe.groups.push_back(go);
  }
  auto router = RouterServer::Start(o);
  ASSERT_TRUE(router.ok()) << router.status();
  router_ = std::move(router).value();

  at::manual_seed(11);
  const at::Tensor x = at::randn({kTokens, kD});
  LocalMoEOptions lo;
  lo.routing = o.moe.routing;
  lo.shape = testing::Shape();
  lo.layer = kLayer;
  auto moe = LocalMoE::Create(lo);
  ASSERT_TRUE(moe.ok()) << moe.status();
  at::NoGradGuard no_grad;
  auto want = (*moe)->Forward(x, /*training=*/false);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_GT(want->output.abs().max().item<double>(), 0.0);
  WriteTensor(x, JoinPath(dir_, "x.pb"));
  WriteTensor(want->output.detach().contiguous(), JoinPath(dir_, "y.pb"));
  if (HasFatalFailure()) return;

  const std::string src = HIMOE_SOURCE_DIR;
  const std::string log = JoinPath(dir_, "python_client.log");
  const int code = RunChild({kPython, src + "/tests/router_service/python_client.py",
                             "--proto_dir", src + "/proto",
                             "--out_dir", JoinPath(dir_, "gen"),
                             "--router", Loopback(router_->port()),
                             "--input", JoinPath(dir_, "x.pb"),
                             "--expected", JoinPath(dir_, "y.pb"),
                             "--layer", std::to_string(kLayer)},
                            log);
  const std::string output = test_util::ReadTextFile(log);
  std::cout << output;
  EXPECT_EQ(code, 0) << "python_client.py failed:\n" << output;
}

}  // namespace
}  // namespace himoe::router
