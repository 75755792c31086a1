#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <list>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/tensor_codec.h"
#include "expert_service/expert_client.h"
#include "expert_service/expert_group.h"
#include "expert_service/expert_grpc_service.h"
#include "expert_service/expert_service_core.h"
#include "expert_service/state_stream.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "proto/grpc_status.h"
#include "tests/expert_service/expert_test_util.h"
#include "tests/raw_grpc_call.h"

extern char** environ;

namespace himoe::expert {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Decode;
using testing::Encode;
using testing::GroupLike;
using testing::MakeShape;
using testing::MaxAbsDiff;

constexpr int kGroup = 1;
constexpr int kNumGroups = 4;
constexpr int kNumExperts = 8;
constexpr int kLayers = 2;
constexpr int64_t kD = 16;
constexpr int64_t kDff = 32;
constexpr uint64_t kSeed = 42;
constexpr int64_t kMaxTokens = 64;

ExpertServiceOptions CoreOptions(uint64_t seed = kSeed,
                                 v1::DType dtype = v1::DTYPE_FLOAT32) {
  ExpertServiceOptions o;
  o.shape = MakeShape(kNumExperts, kNumGroups, kLayers, kD, kDff, seed, dtype);
  o.group_id = kGroup;
  o.max_tokens_per_request = kMaxTokens;
  return o;
}

// The oracle: the group as router_service/local_moe.cc builds it.
std::unique_ptr<ExpertGroup> LocalGroup(int layer, uint64_t seed = kSeed,
                                        v1::DType dtype = v1::DTYPE_FLOAT32) {
  return GroupLike(CoreOptions(seed, dtype), layer);
}

at::Tensor LocalForward(const ExpertGroup& group, int expert, const at::Tensor& rows) {
  auto out = group.Forward(rows, at::full({rows.size(0)}, expert, at::kLong));
  EXPECT_TRUE(out.ok()) << out.status();
  return *out;
}

v1::ExpertForwardRequest MakeRequest(
    int layer, const std::vector<std::pair<int, at::Tensor>>& inputs) {
  v1::ExpertForwardRequest request;
  request.set_layer(layer);
  for (const auto& [expert, rows] : inputs) {
    v1::ExpertRows* in = request.add_inputs();
    in->set_expert_id(expert);
    *in->mutable_rows() = Encode(rows);
  }
  return request;
}

std::vector<v1::StateChunk> ChunksOf(std::vector<NamedTensor> tensors, int64_t bytes) {
  auto chunker = StateChunker::Create(std::move(tensors), bytes);
  EXPECT_TRUE(chunker.ok()) << chunker.status();
  std::vector<v1::StateChunk> chunks;
  v1::StateChunk chunk;
  while ((*chunker)->Next(&chunk)) chunks.push_back(chunk);
  return chunks;
}

std::string BytesOfMessage(const google::protobuf::Message& m) {
  std::string bytes;
  EXPECT_TRUE(m.SerializeToString(&bytes));
  return bytes;
}

std::string BytesOf(grpc::ByteBuffer* buffer) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (!buffer->Dump(&slices).ok()) return bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes;
}

// Keeps one worker of `pool` busy from construction until Release().
class BusyWorker {
 public:
  explicit BusyWorker(ComputePool& pool) : released_(release_.get_future().share()) {
    std::future<void> running = started_.get_future();
    ok_ = pool.Submit([this, released = released_] {
              started_.set_value();
              released.wait();
            }).ok();
    if (ok_) running.wait();
  }
  ~BusyWorker() { Release(); }
  bool ok() const { return ok_; }
  void Release() {
    if (!done_) release_.set_value();
    done_ = true;
  }

 private:
  std::promise<void> started_, release_;
  std::shared_future<void> released_;
  bool ok_ = false, done_ = false;
};

// A server whose compute pool has one worker and `max_queue` queue slots.
std::unique_ptr<ExpertServer> StartWithOneWorker(int max_queue) {
  ExpertServerOptions options;
  options.core = CoreOptions();
  options.compute = ComputePoolOptions{1, max_queue, "--max_queue"};
  auto server = ExpertServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

class ExpertServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ExpertServerOptions options;
    options.core = CoreOptions();
    options.address = "127.0.0.1:0";
    auto server = ExpertServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    stub_ = v1::ExpertService::NewStub(channel_);
  }

  void TearDown() override {
    if (server_ != nullptr) {
      server_->Shutdown(absl::Seconds(5));
      server_->Wait();
    }
  }

  grpc::Status Forward(const v1::ExpertForwardRequest& request,
                       v1::ExpertForwardResponse* response) {
    grpc::ClientContext context;
    return stub_->Forward(&context, request, response);
  }

  std::vector<v1::StateChunk> GetState(int64_t chunk_bytes, grpc::Status* status) {
    grpc::ClientContext context;
    v1::GetStateRequest request;
    request.set_chunk_bytes(chunk_bytes);
    auto reader = stub_->GetState(&context, request);
    std::vector<v1::StateChunk> chunks;
    v1::StateChunk chunk;
    while (reader->Read(&chunk)) chunks.push_back(chunk);
    *status = reader->Finish();
    return chunks;
  }

  grpc::Status SetState(const std::vector<v1::StateChunk>& chunks,
                        v1::SetStateResponse* response) {
    grpc::ClientContext context;
    auto writer = stub_->SetState(&context, response);
    for (const v1::StateChunk& chunk : chunks) {
      if (!writer->Write(chunk)) break;  // the server finished early
    }
    writer->WritesDone();
    return writer->Finish();
  }

  std::unique_ptr<ExpertServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ExpertService::Stub> stub_;
};

// A TCP relay on 127.0.0.1 that holds every connection `delay` before it
// connects on to `target_port`: a server slow to answer the handshake, as a
// service on a loaded machine is. Hold() stops carrying bytes either way with
// the connections left open, as a stopped process or a cut link does.
class SlowRelay {
 public:
  SlowRelay(int target_port, std::chrono::milliseconds delay) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(listen(listen_fd_, 16), 0);
    EXPECT_EQ(getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this, target_port, delay] {
      while (true) {
        const int client = accept(listen_fd_, nullptr, nullptr);
        if (client < 0) return;  // shut down
        std::lock_guard<std::mutex> lock(mu_);
        fds_.push_back(client);
        relays_.emplace_back([this, client, target_port, delay] {
          std::this_thread::sleep_for(delay);
          const int server = socket(AF_INET, SOCK_STREAM, 0);
          {
            std::lock_guard<std::mutex> lock(mu_);
            fds_.push_back(server);
          }
          sockaddr_in to{};
          to.sin_family = AF_INET;
          to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          to.sin_port = htons(static_cast<uint16_t>(target_port));
          if (connect(server, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) return;
          pollfd both[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
          char buffer[1 << 16];
          while (poll(both, 2, 20) >= 0 && !stopping_) {
            if (held_) {  // the bytes wait in the sockets' buffers
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
              continue;
            }
            for (int i = 0; i < 2; ++i) {
              if (both[i].revents == 0) continue;
              const ssize_t n = read(both[i].fd, buffer, sizeof(buffer));
              // MSG_NOSIGNAL: a peer that closed first must not SIGPIPE the test.
              if (n <= 0 || send(both[1 - i].fd, buffer, n, MSG_NOSIGNAL) != n) return;
            }
          }
        });
      }
    });
  }

  ~SlowRelay() {
    stopping_ = true;
    shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const int fd : fds_) shutdown(fd, SHUT_RDWR);
    }
    for (std::thread& t : relays_) t.join();
    for (const int fd : fds_) close(fd);
    close(listen_fd_);
  }

  int port() const { return port_; }
  void Hold(bool held) { held_ = held; }

 private:
  std::atomic<bool> held_{false};
  std::atomic<bool> stopping_{false};
  int listen_fd_ = -1;
  int port_ = 0;
  std::mutex mu_;
  std::vector<int> fds_;
  std::list<std::thread> relays_;
  std::thread acceptor_;
};

// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is gRPC's minimum connect timeout: set
// to 100 ms, a handshake slower than that (8 expert processes starting on 2
// cores, TLS under load) would read as "unreachable", so the client leaves it.
TEST_F(ExpertServiceTest, TheClientWaitsOutASlowHandshake) {
  SlowRelay relay(server_->port(), std::chrono::milliseconds(600));
  ExpertGroupClientOptions options;
  options.group_id = kGroup;
  options.addresses = {absl::StrCat("127.0.0.1:", relay.port())};
  options.deadline = std::chrono::seconds(20);
  auto client = ExpertGroupClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::StatusOr<v1::ExpertInfoResponse> info = (*client)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->group_id(), kGroup);
}

TEST_F(ExpertServiceTest, InfoDescribesTheGroup) {
  grpc::ClientContext context;
  v1::ExpertInfoResponse info;
  ASSERT_TRUE(stub_->Info(&context, v1::ExpertInfoRequest(), &info).ok());
  EXPECT_EQ(info.group_id(), kGroup);
  EXPECT_THAT(info.expert_ids(), ElementsAre(2, 3));
  EXPECT_THAT(info.layers(), ElementsAre(0, 1));
  EXPECT_EQ(info.d_model(), kD);
  EXPECT_EQ(info.d_ff(), kDff);
  EXPECT_EQ(info.dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(info.device(), "cpu");
  EXPECT_EQ(info.version(), kExpertServiceVersion);
  EXPECT_EQ(info.num_experts(), kNumExperts);
  EXPECT_EQ(info.num_groups(), kNumGroups);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(info.shape(), CoreOptions().shape))
      << info.shape().DebugString();
}

TEST_F(ExpertServiceTest, Fp32ForwardEqualsLocalExpertGroup) {
  const at::Tensor a = at::randn({5, kD});
  const at::Tensor b = at::randn({3, kD});
  const at::Tensor empty = at::empty({0, kD});
  v1::ExpertForwardResponse response;
  ASSERT_TRUE(Forward(MakeRequest(1, {{3, a}, {2, b}, {3, empty}}), &response).ok());
  ASSERT_EQ(response.outputs_size(), 3);
  const auto group = LocalGroup(1);
  const std::vector<std::pair<int, at::Tensor>> want = {
      {3, LocalForward(*group, 3, a)}, {2, LocalForward(*group, 2, b)}, {3, empty}};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(response.outputs(i).expert_id(), want[i].first);
    EXPECT_EQ(response.outputs(i).rows().dtype(), v1::DTYPE_FLOAT32);
    const at::Tensor got = Decode(response.outputs(i).rows());
    ASSERT_EQ(got.sizes(), want[i].second.sizes()) << "output " << i;
    if (got.numel() > 0) {
      EXPECT_LE(MaxAbsDiff(got, want[i].second), 1e-6) << i;
    }
  }
  // Layer 0 has other weights.
  v1::ExpertForwardResponse layer0;
  ASSERT_TRUE(Forward(MakeRequest(0, {{3, a}}), &layer0).ok());
  EXPECT_LE(MaxAbsDiff(Decode(layer0.outputs(0).rows()), LocalForward(*LocalGroup(0), 3, a)),
            1e-6);

  const ExpertServiceCounters c = server_->core()->counters();
  EXPECT_THAT(c.tokens_per_layer_expert[1], ElementsAre(3, 5));
  EXPECT_THAT(c.tokens_per_expert, ElementsAre(3, 10));
  EXPECT_EQ(c.forward_requests, 2);
  EXPECT_EQ(c.forward_failures, 0);
  EXPECT_EQ(c.bytes_in, (5 + 3 + 5) * kD * 4);
  EXPECT_EQ(c.bytes_out, c.bytes_in);
  EXPECT_EQ(c.in_flight, 0);
}

TEST_F(ExpertServiceTest, Bf16RequestGetsBf16Answer) {
  const at::Tensor rows = at::randn({4, kD}).to(at::kBFloat16);
  v1::ExpertForwardResponse response;
  ASSERT_TRUE(Forward(MakeRequest(0, {{2, rows}}), &response).ok());
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).rows().dtype(), v1::DTYPE_BFLOAT16);
  const at::Tensor got = Decode(response.outputs(0).rows());
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  const at::Tensor want = LocalForward(*LocalGroup(0), 2, rows).to(at::kBFloat16);
  EXPECT_LE(MaxAbsDiff(got, want), 1e-2);
}

struct BadCase {
  std::string name;
  std::function<void(v1::ExpertForwardRequest*)> mutate;
  std::string message;
};

TEST_F(ExpertServiceTest, BadInputsAreInvalidArgumentAndServerKeepsServing) {
  const std::vector<BadCase> cases = {
      {"wrong d_model",
       [](v1::ExpertForwardRequest* r) {
         *r->mutable_inputs(0)->mutable_rows() = Encode(at::randn({2, kD - 1}));
       },
       "inputs[0].rows: expected shape [n, 16] (2-D, d_model=16), got [2, 15]"},
      {"not 2-D",
       [](v1::ExpertForwardRequest* r) {
         *r->mutable_inputs(1)->mutable_rows() = Encode(at::randn({kD}));
       },
       "inputs[1].rows: expected shape [n, 16] (2-D, d_model=16), got [16]"},
      {"dtype unknown",
       [](v1::ExpertForwardRequest* r) {
         r->mutable_inputs(0)->mutable_rows()->set_dtype(static_cast<v1::DType>(99));
       },
       "inputs[0].rows.dtype: unknown or unspecified value 99"},
      {"integer dtype",
       [](v1::ExpertForwardRequest* r) {
         *r->mutable_inputs(0)->mutable_rows() = Encode(at::ones({2, kD}, at::kLong));
       },
       "inputs[0].rows.dtype: Long is not a floating type"},
      {"byte length",
       [](v1::ExpertForwardRequest* r) {
         r->mutable_inputs(1)->mutable_rows()->mutable_data()->resize(10);
       },
       "inputs[1].rows.data has 10 bytes; shape [3,16] of Float needs 192"},
      {"NaN",
       [](v1::ExpertForwardRequest* r) {
         at::Tensor x = at::randn({2, kD});
         x[1][3] = std::numeric_limits<float>::quiet_NaN();
         *r->mutable_inputs(0)->mutable_rows() = Encode(x);
       },
       "inputs[0].rows contains NaN or Inf"},
      {"Inf",
       [](v1::ExpertForwardRequest* r) {
         at::Tensor x = at::randn({3, kD});
         x[0][0] = -std::numeric_limits<float>::infinity();
         *r->mutable_inputs(1)->mutable_rows() = Encode(x.to(at::kBFloat16));
       },
       "inputs[1].rows contains NaN or Inf"},
      {"finite but huge",
       [](v1::ExpertForwardRequest* r) {
         *r->mutable_inputs(0)->mutable_rows() = Encode(at::full({2, kD}, 3e38));
       },
       "layer 1, group 1: the experts' outputs are not finite (NaN or Inf); the input rows "
       "(max |x| = 3e+38) or their weights overflow them"},
      {"empty batch", [](v1::ExpertForwardRequest* r) { r->clear_inputs(); },
       "inputs: the request is empty"},
      {"zero rows",
       [](v1::ExpertForwardRequest* r) {
         *r->mutable_inputs(0)->mutable_rows() = Encode(at::empty({0, kD}));
         *r->mutable_inputs(1)->mutable_rows() = Encode(at::empty({0, kD}));
       },
       "inputs: the request has no rows"},
      {"unknown layer", [](v1::ExpertForwardRequest* r) { r->set_layer(7); },
       "layer: 7 is not served; layers are [0, 2)"},
      {"negative layer", [](v1::ExpertForwardRequest* r) { r->set_layer(-1); },
       "layer: -1 is not served; layers are [0, 2)"},
      {"over token limit",
       [](v1::ExpertForwardRequest* r) {
         *r->mutable_inputs(1)->mutable_rows() = Encode(at::randn({kMaxTokens - 1, kD}));
       },
       "inputs: 65 rows in total exceed max_tokens_per_request=64"},
      {"expert outside group",
       [](v1::ExpertForwardRequest* r) { r->mutable_inputs(1)->set_expert_id(4); },
       "inputs[1].expert_id: 4 is outside group 1; expected an expert id in [2, 4)"},
  };
  const v1::ExpertForwardRequest good =
      MakeRequest(1, {{2, at::randn({2, kD})}, {3, at::randn({3, kD})}});
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::ExpertForwardRequest request = good;
    c.mutate(&request);
    v1::ExpertForwardResponse response;
    const grpc::Status status = Forward(request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr(c.message));
  }
  v1::ExpertForwardResponse response;
  ASSERT_TRUE(Forward(good, &response).ok());
  EXPECT_EQ(response.outputs_size(), 2);
  EXPECT_EQ(server_->core()->counters().forward_failures,
            static_cast<int64_t>(cases.size()));
}

// The training RPCs are served (tests/expert_service/expert_training_test.cc
// checks their results); here only that they answer with the right codes.
TEST_F(ExpertServiceTest, TrainingRpcsAnswer) {
  v1::ExpertForwardRequest request = MakeRequest(0, {{2, at::randn({1, kD})}});
  request.set_save_for_backward(true);
  v1::ExpertForwardResponse response;
  ASSERT_TRUE(Forward(request, &response).ok());
  EXPECT_EQ(response.outputs_size(), 1);
  {
    grpc::ClientContext context;
    v1::ExpertBackwardResponse r;
    v1::ExpertBackwardRequest backward;
    backward.set_step(3);
    const grpc::Status s = stub_->Backward(&context, backward, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("no saved Forward (step=3"));
  }
  {
    grpc::ClientContext context;
    v1::ExpertStepResponse r;
    const grpc::Status s = stub_->Step(&context, v1::ExpertStepRequest(), &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("eps: 0"));
  }
  {
    grpc::ClientContext context;
    v1::ExpertAbortResponse r;
    ASSERT_TRUE(stub_->Abort(&context, v1::ExpertAbortRequest(), &r).ok());
    EXPECT_EQ(r.freed(), 1);
  }
}

TEST_F(ExpertServiceTest, ConcurrentForwardsAllMatch) {
  const at::Tensor rows = at::randn({6, kD});
  const at::Tensor want = LocalForward(*LocalGroup(1), 3, rows);
  const v1::ExpertForwardRequest request = MakeRequest(1, {{3, rows}});
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10; ++i) {
        v1::ExpertForwardResponse response;
        if (!Forward(request, &response).ok() ||
            MaxAbsDiff(Decode(response.outputs(0).rows()), want) > 1e-6) {
          ++bad[t];
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_THAT(bad, ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(server_->core()->counters().tokens_per_layer_expert[1], ElementsAre(0, 240));
}

TEST_F(ExpertServiceTest, StateRoundTripsThroughChunkedStreams) {
  grpc::Status status;
  const std::vector<v1::StateChunk> chunks = GetState(100, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<std::string> names;
  StateAssembler assembler;
  for (const v1::StateChunk& chunk : chunks) {
    EXPECT_LE(chunk.data().size(), 100u);
    if (chunk.last()) names.push_back(chunk.name());
    ASSERT_TRUE(assembler.Add(chunk).ok());
  }
  EXPECT_THAT(names, ElementsAre("layer0.w1", "layer0.b1", "layer0.w2", "layer0.b2",
                                 "layer1.w1", "layer1.b1", "layer1.w2", "layer1.b2"));
  // w1 alone is 2*32*16*4 = 4096 bytes: 41 chunks of <= 100 bytes.
  EXPECT_GT(chunks.size(), 8u * 2);
  auto fetched = assembler.Finish();
  ASSERT_TRUE(fetched.ok());
  const auto local = LocalGroup(1)->named_parameters();
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::equal((*fetched)[4 + i].second, local[i].second.detach()))
        << local[i].first;
  }

  // Load the weights of another seed, chunked, then check Forward and GetState.
  auto other = ExpertServiceCore::Create(CoreOptions(/*seed=*/7));
  ASSERT_TRUE(other.ok());
  auto other_state = (*other)->GetState();
  ASSERT_TRUE(other_state.ok());
  v1::SetStateResponse set_response;
  status = SetState(ChunksOf(*other_state, 100), &set_response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(set_response.tensors(), 8);

  const at::Tensor rows = at::randn({4, kD});
  v1::ExpertForwardResponse response;
  ASSERT_TRUE(Forward(MakeRequest(1, {{2, rows}}), &response).ok());
  EXPECT_LE(MaxAbsDiff(Decode(response.outputs(0).rows()),
                       LocalForward(*LocalGroup(1, 7), 2, rows)),
            1e-6);
  const std::vector<v1::StateChunk> again = GetState(0, &status);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(again.size(), 8u);  // default 1 MiB chunks: one per tensor
  for (size_t i = 0; i < again.size(); ++i) {
    EXPECT_TRUE(at::equal(Decode([&] {
                            v1::Tensor t;
                            t.set_dtype(again[i].dtype());
                            *t.mutable_shape() = again[i].shape();
                            t.set_data(again[i].data());
                            return t;
                          }()),
                          (*other_state)[i].second))
        << again[i].name();
  }
}

TEST_F(ExpertServiceTest, SetStateRejectsBadTensorsAndAppliesNothing) {
  const at::Tensor new_b1 = at::ones({2, kDff});
  const struct {
    std::string name;
    std::vector<NamedTensor> tensors;
    std::string message;
  } cases[] = {
      {"wrong shape",
       {{"layer0.b1", new_b1}, {"layer0.w1", at::zeros({2, kDff, kD - 1})}},
       "state 'layer0.w1': shape [2, 32, 15] does not match the parameter's [2, 32, 16]"},
      {"wrong dtype",
       {{"layer0.b1", new_b1}, {"layer0.w1", at::zeros({2, kDff, kD}, at::kBFloat16)}},
       "state 'layer0.w1': dtype BFloat16 does not match the parameter's Float"},
      {"unknown name",
       {{"layer0.b1", new_b1}, {"layer2.w1", at::zeros({2, kDff, kD})}},
       "state: unknown tensor name 'layer2.w1'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    v1::SetStateResponse response;
    const grpc::Status status = SetState(ChunksOf(c.tensors, 100), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr(c.message));
  }
  // A broken stream: the last chunk of a tensor is missing.
  std::vector<v1::StateChunk> chunks = ChunksOf({{"layer0.b1", new_b1}}, 100);
  chunks.pop_back();
  v1::SetStateResponse response;
  const grpc::Status truncated = SetState(chunks, &response);
  EXPECT_EQ(truncated.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(truncated.error_message(),
              HasSubstr("state stream ended with 'layer0.b1' incomplete (200 of 256 bytes)"));

  auto state = server_->core()->GetState();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)[1].first, "layer0.b1");
  EXPECT_TRUE(at::equal((*state)[1].second, LocalGroup(0)->parameters()[1].detach()));
}

TEST_F(ExpertServiceTest, HealthCheckReportsServing) {
  grpc::GenericStub generic(channel_);
  // grpc.health.v1.HealthCheckRequest{service}: field 1, length-delimited.
  const auto check = [&](const std::string& service, std::string* reply) {
    std::string request_bytes;
    if (!service.empty()) {
      request_bytes = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
    }
    grpc::Slice slice(request_bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext context;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                      &request, &response,
                      [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status status = done.get_future().get();
    if (status.ok()) *reply = BytesOf(&response);
    return status;
  };
  // HealthCheckResponse{status: SERVING (1)} is the two bytes 08 01.
  std::string reply;
  ASSERT_TRUE(check("", &reply).ok());
  EXPECT_EQ(reply, std::string("\x08\x01", 2));
  ASSERT_TRUE(check("himoe.v1.ExpertService", &reply).ok());
  EXPECT_EQ(reply, std::string("\x08\x01", 2));
  EXPECT_EQ(check("no.such.Service", &reply).error_code(), grpc::StatusCode::NOT_FOUND);
}

// One request/response exchange on the reflection service's bidi stream.
class ReflectionCall final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ReflectionCall(grpc::GenericStub* stub, const std::string& request_bytes) {
    grpc::Slice slice(request_bytes);
    request_ = grpc::ByteBuffer(&slice, 1);
    stub->PrepareBidiStreamingCall(
        &context_, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&response_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (ok) reply_ = BytesOf(&response_);
  }
  void OnDone(const grpc::Status& status) override { done_.set_value(status); }

  grpc::Status Await() { return done_.get_future().get(); }
  const std::string& reply() const { return reply_; }

 private:
  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  std::string reply_;
  std::promise<grpc::Status> done_;
};

TEST_F(ExpertServiceTest, ReflectionListsTheServices) {
  grpc::GenericStub generic(channel_);
  // ServerReflectionRequest{list_services: ""}: field 7, empty string.
  ReflectionCall call(&generic, std::string("\x3a\x00", 2));
  const grpc::Status status = call.Await();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(call.reply(), HasSubstr("himoe.v1.ExpertService"));
  EXPECT_THAT(call.reply(), HasSubstr("grpc.health.v1.Health"));
}

// Bytes that are not a request message, on every method: the typed callback
// API answered UNIMPLEMENTED with an empty message.
TEST_F(ExpertServiceTest, UnparsableRequestBytesAreInvalidArgument) {
  // Field 2^32 - 1 with wire type 7, which no message has.
  const std::string garbage = "\xff\xff\xff\xff\x0f not a protobuf message";
  const std::pair<const char*, const char*> calls[] = {
      {"Info", "ExpertInfoRequest"},   {"Forward", "ExpertForwardRequest"},
      {"Backward", "ExpertBackwardRequest"}, {"Step", "ExpertStepRequest"},
      {"Abort", "ExpertAbortRequest"}, {"BeginRun", "BeginRunRequest"},
      {"GetState", "GetStateRequest"}};
  for (const auto& [method, message] : calls) {
    const testutil::RawCallResult r =
        testutil::RawCall(channel_, absl::StrCat("/himoe.v1.ExpertService/", method), {garbage});
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_EQ(r.status.error_message(), absl::StrCat("request: ", garbage.size(),
                                                     " bytes do not parse as himoe.v1.", message))
        << method;
    EXPECT_TRUE(r.replies.empty()) << method;
  }
  v1::ExpertForwardResponse good;
  EXPECT_TRUE(Forward(MakeRequest(1, {{2, at::randn({2, kD})}}), &good).ok());
}

// SetState: a stream whose second message is not a StateChunk is refused
// naming the chunk, and nothing of it is applied (its first chunk was valid).
TEST_F(ExpertServiceTest, AnUnparsableStateChunkIsInvalidArgumentAndAppliesNothing) {
  grpc::Status status;
  const std::vector<v1::StateChunk> before = GetState(0, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_GE(before.size(), 2u);
  v1::StateChunk changed = before[0];
  ASSERT_TRUE(changed.last()) << "a small tensor fits in one chunk";
  for (char& c : *changed.mutable_data()) c = static_cast<char>(c ^ 0x55);
  const std::string garbage = "\xff\xff\xff\xff\x0f not a protobuf message";
  const testutil::RawCallResult r = testutil::RawCall(
      channel_, "/himoe.v1.ExpertService/SetState", {changed.SerializeAsString(), garbage});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(),
            absl::StrCat("state chunk 1: ", garbage.size(),
                         " bytes do not parse as himoe.v1.StateChunk"));
  const std::vector<v1::StateChunk> after = GetState(0, &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].SerializeAsString(), before[i].SerializeAsString()) << before[i].name();
  }
}

// Compute runs on a bounded pool: with its one worker busy and its one queue
// slot taken, a Forward is RESOURCE_EXHAUSTED at once naming the limit; the
// queued one is computed once the worker is free, and serving goes on.
TEST_F(ExpertServiceTest, AFullComputeQueueIsResourceExhaustedThenServingGoesOn) {
  std::unique_ptr<ExpertServer> server = StartWithOneWorker(1);
  ASSERT_NE(server, nullptr);
  auto stub = v1::ExpertService::NewStub(
      grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  BusyWorker busy(server->compute_pool());
  ASSERT_TRUE(busy.ok());

  const v1::ExpertForwardRequest request = MakeRequest(1, {{2, at::randn({3, kD})}});
  v1::ExpertForwardResponse queued_response;
  grpc::ClientContext queued_context;
  std::promise<grpc::Status> queued;
  stub->async()->Forward(&queued_context, &request, &queued_response,
                         [&queued](grpc::Status s) { queued.set_value(std::move(s)); });
  for (int i = 0; i < 1000 && server->compute_pool().queued() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(server->compute_pool().queued(), 1);

  grpc::ClientContext context;
  v1::ExpertForwardResponse response;
  const grpc::Status full = stub->Forward(&context, request, &response);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(full.error_message(),
            "compute queue full: 1 requests waiting for 1 busy worker(s) (--max_queue = 1); "
            "retry later");
  EXPECT_EQ(server->compute_pool().rejected(), 1);

  busy.Release();
  const grpc::Status done = queued.get_future().get();
  ASSERT_TRUE(done.ok()) << done.error_message();
  grpc::ClientContext again;
  v1::ExpertForwardResponse alone;
  ASSERT_TRUE(stub->Forward(&again, request, &alone).ok());
  EXPECT_EQ(BytesOfMessage(queued_response), BytesOfMessage(alone));
}

// GetState's snapshot and SetState's apply run on the compute pool, in its
// FIFO order: with the one worker busy both wait (SetState has applied
// nothing), one more call is RESOURCE_EXHAUSTED naming the limit, and once the
// worker frees, GetState gives the weights from before the SetState that was
// queued after it, and SetState then applies its own.
TEST_F(ExpertServiceTest, StateCallsRunOnTheComputePoolInTheirOrder) {
  std::unique_ptr<ExpertServer> server = StartWithOneWorker(2);
  ASSERT_NE(server, nullptr);
  auto stub = v1::ExpertService::NewStub(
      grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  ComputePool& pool = server->compute_pool();
  const auto wait_queued = [&pool](int64_t n) {
    for (int i = 0; i < 1000 && pool.queued() < n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return pool.queued();
  };
  const auto tensor_of = [](const v1::StateChunk& chunk) {
    v1::Tensor t;
    t.set_dtype(chunk.dtype());
    *t.mutable_shape() = chunk.shape();
    t.set_data(chunk.data());
    return Decode(t);
  };
  auto own = server->core()->GetState();
  ASSERT_TRUE(own.ok()) << own.status();
  auto other = ExpertServiceCore::Create(CoreOptions(/*seed=*/7));
  ASSERT_TRUE(other.ok());
  auto other_state = (*other)->GetState();
  ASSERT_TRUE(other_state.ok());
  ASSERT_EQ(own->size(), other_state->size());
  ASSERT_FALSE(at::equal((*own)[0].second, (*other_state)[0].second));

  BusyWorker busy(pool);
  ASSERT_TRUE(busy.ok());

  std::vector<v1::StateChunk> got;
  grpc::Status get_status;
  std::thread getter([&] {
    grpc::ClientContext context;
    auto reader = stub->GetState(&context, v1::GetStateRequest());
    v1::StateChunk chunk;
    while (reader->Read(&chunk)) got.push_back(chunk);
    get_status = reader->Finish();
  });
  ASSERT_EQ(wait_queued(1), 1);
  v1::SetStateResponse set_response;
  grpc::Status set_status;
  std::thread setter([&] {
    grpc::ClientContext context;
    auto writer = stub->SetState(&context, &set_response);
    for (const v1::StateChunk& chunk : ChunksOf(*other_state, 100)) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    set_status = writer->Finish();
  });
  EXPECT_EQ(wait_queued(2), 2);
  auto waiting = server->core()->GetState();
  ASSERT_TRUE(waiting.ok());
  for (size_t i = 0; i < own->size(); ++i) {
    EXPECT_TRUE(at::equal((*waiting)[i].second, (*own)[i].second)) << (*own)[i].first;
  }

  grpc::ClientContext full_context;
  auto full_reader = stub->GetState(&full_context, v1::GetStateRequest());
  v1::StateChunk none;
  EXPECT_FALSE(full_reader->Read(&none));
  const grpc::Status full = full_reader->Finish();
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(full.error_message(),
            "compute queue full: 2 requests waiting for 1 busy worker(s) (--max_queue = 2); "
            "retry later");

  busy.Release();
  getter.join();
  setter.join();
  ASSERT_TRUE(get_status.ok()) << get_status.error_message();
  ASSERT_EQ(got.size(), own->size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].name(), (*own)[i].first);
    EXPECT_TRUE(at::equal(tensor_of(got[i]), (*own)[i].second)) << got[i].name();
  }
  ASSERT_TRUE(set_status.ok()) << set_status.error_message();
  EXPECT_EQ(set_response.tensors(), static_cast<int32_t>(other_state->size()));
  auto after = server->core()->GetState();
  ASSERT_TRUE(after.ok());
  for (size_t i = 0; i < after->size(); ++i) {
    EXPECT_TRUE(at::equal((*after)[i].second, (*other_state)[i].second))
        << (*other_state)[i].first;
  }
}

// A call whose deadline passes while it waits for a compute worker is not
// computed.
TEST_F(ExpertServiceTest, ACallThatExpiredWaitingForComputeIsNotComputed) {
  BusyWorker busy(server_->compute_pool());
  ASSERT_TRUE(busy.ok());
  const int64_t before = server_->core()->counters().forward_requests;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  v1::ExpertForwardResponse response;
  const grpc::Status status =
      stub_->Forward(&context, MakeRequest(1, {{2, at::randn({3, kD})}}), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's deadline is the client's plus the request's transit (it
  // receives a relative timeout): let that pass too before the worker frees.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  busy.Release();
  // The queued call ran to its deadline check; the core never saw it.
  for (int i = 0; i < 1000 && server_->compute_pool().completed() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(server_->compute_pool().completed(), 2);
  EXPECT_EQ(server_->core()->counters().forward_requests, before);
}

// A second server on a port already served is refused: with SO_REUSEPORT the
// kernel would split connections between the two processes, and a router
// would get answers from whichever group happened to take the port.
TEST_F(ExpertServiceTest, APortAlreadyServedIsRefused) {
  ExpertServerOptions options;
  options.core = CoreOptions();
  options.address = server_->address();
  auto second = ExpertServer::Start(options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("cannot listen on '" + server_->address() + "'"));
}

TEST(ExpertServiceCoreTest, Bf16GroupAnswersInTheRequestDtype) {
  auto core = ExpertServiceCore::Create(CoreOptions(kSeed, v1::DTYPE_BFLOAT16));
  ASSERT_TRUE(core.ok()) << core.status();
  EXPECT_EQ((*core)->Info().shape.dtype(), v1::DTYPE_BFLOAT16);
  const at::Tensor rows = at::randn({5, kD});
  v1::ExpertForwardResponse response;
  ASSERT_TRUE((*core)->Forward(MakeRequest(0, {{3, rows}}), &response).ok());
  EXPECT_EQ(response.outputs(0).rows().dtype(), v1::DTYPE_FLOAT32);
  const at::Tensor want = LocalForward(*LocalGroup(0), 3, rows);
  const at::Tensor got = Decode(response.outputs(0).rows());
  EXPECT_LE(MaxAbsDiff(got, want), 2e-2 * (1 + want.abs().max().item<double>()));
}

TEST(ExpertServiceCoreTest, RejectsBadOptions) {
  ExpertServiceOptions o = CoreOptions();
  o.shape.set_num_experts(7);
  EXPECT_THAT(std::string(ExpertServiceCore::Create(o).status().message()),
              HasSubstr("num_experts (N=7) must be a multiple of num_groups (M=4)"));
  o = CoreOptions();
  o.group_id = 4;
  EXPECT_THAT(std::string(ExpertServiceCore::Create(o).status().message()),
              HasSubstr("group_id: 4 is outside [0, 4)"));
  o = CoreOptions();
  o.shape.set_dtype(v1::DTYPE_FLOAT16);
  EXPECT_EQ(ExpertServiceCore::Create(o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = CoreOptions();
  o.shape.set_num_layers(0);
  EXPECT_THAT(std::string(ExpertServiceCore::Create(o).status().message()),
              HasSubstr("num_layers must be >= 1, got 0"));
}

TEST(StateChunkTest, AssemblerRejectsMalformedStreams) {
  const at::Tensor t = at::arange(50, at::kFloat);  // 200 bytes
  const std::vector<v1::StateChunk> chunks = ChunksOf({{"a", t}, {"b", t}}, 64);
  ASSERT_EQ(chunks.size(), 8u);  // 64+64+64+8 per tensor
  const auto run = [](const std::vector<v1::StateChunk>& stream) -> absl::Status {
    StateAssembler assembler;
    for (const auto& c : stream) {
      absl::Status s = assembler.Add(c);
      if (!s.ok()) return s;
    }
    return assembler.Finish().status();
  };
  EXPECT_TRUE(run(chunks).ok());

  std::vector<v1::StateChunk> s = chunks;
  std::swap(s[1], s[2]);
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("offset 128; expected 64"));
  s = chunks;
  s[3].set_last(false);
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("not marked last"));
  s = chunks;
  s[1].set_last(true);
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("marked last at 128 of 200 bytes"));
  s = chunks;
  s[3].mutable_data()->append("xyz");
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("run past the tensor's 200 bytes"));
  s = chunks;
  s.erase(s.begin() + 3);
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("arrived before 'a' was complete"));
  s = chunks;
  s[5].set_name("a");
  s[4].set_name("a");
  s[6].set_name("a");
  s[7].set_name("a");
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("'a': the tensor was already received"));
  s = chunks;
  s[2].add_shape(1);
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("dtype or shape differ"));
  s = chunks;
  s[0].set_dtype(static_cast<v1::DType>(42));
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("unknown or unspecified value 42"));
  s = {chunks[0]};
  EXPECT_THAT(std::string(run(s).message()), HasSubstr("ended with 'a' incomplete"));

  // An empty tensor is one empty chunk marked last.
  const auto empty = ChunksOf({{"e", at::empty({0, 3})}}, 64);
  ASSERT_EQ(empty.size(), 1u);
  EXPECT_TRUE(empty[0].last());
  EXPECT_TRUE(run(empty).ok());
}

TEST(StateFileTest, SaveAndLoadRoundTrip) {
  const std::string path = ::testing::TempDir() + "/expert_state_" +
                           std::to_string(getpid()) + ".bin";
  auto source = ExpertServiceCore::Create(CoreOptions(/*seed=*/7));
  auto target = ExpertServiceCore::Create(CoreOptions());
  ASSERT_TRUE(source.ok() && target.ok());
  absl::Status saved = SaveStateToFile(**source, path, 100);
  ASSERT_TRUE(saved.ok()) << saved;
  absl::Status loaded = LoadStateFromFile(path, target->get());
  ASSERT_TRUE(loaded.ok()) << loaded;
  auto a = (*source)->GetState();
  auto b = (*target)->GetState();
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_TRUE(at::equal((*a)[i].second, (*b)[i].second)) << (*a)[i].first;
  }
  // A truncated file is refused.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 5));
  }
  EXPECT_EQ(LoadStateFromFile(path, target->get()).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(LoadStateFromFile(path + ".missing", target->get()).code(),
            absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

// --- ExpertGroupClient ----------------------------------------------------------

std::unique_ptr<ExpertGroupClient> Client(int group_id, std::vector<std::string> addresses) {
  ExpertGroupClientOptions o;
  o.group_id = group_id;
  o.addresses = std::move(addresses);
  o.deadline = std::chrono::seconds(60);
  auto client = ExpertGroupClient::Create(o);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

TEST_F(ExpertServiceTest, CheckInfoRefusesAnotherSeedOrDtype) {
  auto client = Client(kGroup, {server_->address()});
  const absl::Status same = client->CheckInfo(CoreOptions().shape);
  EXPECT_TRUE(same.ok()) << same;

  const absl::Status seed = client->CheckInfo(CoreOptions(/*seed=*/7).shape);
  EXPECT_EQ(seed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(seed.message()),
              HasSubstr("expert service at " + server_->address() + " (group 1)"));
  EXPECT_THAT(std::string(seed.message()), HasSubstr("serves seed 42; the model needs seed 7"));

  const absl::Status dtype = client->CheckInfo(CoreOptions(kSeed, v1::DTYPE_BFLOAT16).shape);
  EXPECT_EQ(dtype.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(dtype.message()),
              HasSubstr("serves dtype float32; the model needs dtype bfloat16"));

  const absl::Status both = client->CheckInfo(CoreOptions(7, v1::DTYPE_BFLOAT16).shape);
  EXPECT_THAT(std::string(both.message()),
              HasSubstr("serves seed 42, dtype float32; the model needs seed 7, dtype bfloat16"));

  const absl::Status group = Client(kGroup + 1, {server_->address()})->CheckInfo(
      CoreOptions().shape);
  EXPECT_EQ(group.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(group.message()), HasSubstr("serves group 1; expected group 2"));

  // Info fails over: a dead first address, then the service.
  const absl::Status failover =
      Client(kGroup, {"127.0.0.1:1", server_->address()})->CheckInfo(CoreOptions().shape);
  EXPECT_TRUE(failover.ok()) << failover;
}

TEST_F(ExpertServiceTest, ClientStateRoundTripsInChunks) {
  auto client = Client(kGroup, {server_->address()});
  auto fetched = client->GetState(/*include_optimizer=*/false);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  auto served = server_->core()->GetState();
  ASSERT_TRUE(served.ok());
  ASSERT_EQ(fetched->size(), served->size());
  for (size_t i = 0; i < served->size(); ++i) {
    EXPECT_EQ((*fetched)[i].first, (*served)[i].first);
    EXPECT_TRUE(at::equal((*fetched)[i].second, (*served)[i].second)) << (*served)[i].first;
  }

  auto other = ExpertServiceCore::Create(CoreOptions(/*seed=*/7));
  ASSERT_TRUE(other.ok());
  auto other_state = (*other)->GetState();
  ASSERT_TRUE(other_state.ok());
  const absl::Status set = client->SetState(*other_state, /*chunk_bytes=*/100);
  ASSERT_TRUE(set.ok()) << set;
  auto now = server_->core()->GetState();
  ASSERT_TRUE(now.ok());
  for (size_t i = 0; i < now->size(); ++i) {
    EXPECT_TRUE(at::equal((*now)[i].second, (*other_state)[i].second)) << (*now)[i].first;
  }

  // A refused tensor comes back as the service's error, naming the group.
  const absl::Status bad = client->SetState({{"layer9.w1", at::zeros({2, kDff, kD})}});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("expert group 1 at " + server_->address()));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("unknown tensor name 'layer9.w1'"));
}

// A call's gRPC context holds a reference to its channel. It is released
// before `done` runs, so a caller woken by `done` that destroys the client
// destroys the channels on its own thread, never leaving the last reference to
// gRPC's callback thread (which would end gRPC's callback queue under itself:
// the trainer's intermittent double free at exit). Through a failover too.
TEST_F(ExpertServiceTest, ACallReleasesItsContextBeforeDone) {
  auto client = Client(kGroup, {"127.0.0.1:1", server_->address()});
  const at::Tensor a = at::randn({4, kD});
  const v1::ExpertForwardRequest request = MakeRequest(1, {{3, a}});
  v1::ExpertForwardResponse response;
  std::promise<std::pair<absl::Status, int>> finished;
  client->ForwardAsync(&request, &response, [&](absl::Status s) {
    finished.set_value({std::move(s), client->calls_in_flight()});
  });
  const auto [status, in_flight_at_done] = finished.get_future().get();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(in_flight_at_done, 0);
  client.reset();  // right away, as the trainer does at its end
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_LE(MaxAbsDiff(Decode(response.outputs(0).rows()), LocalForward(*LocalGroup(1), 3, a)),
            1e-6);
}

// A client of the group behind `port` with a 200 ms liveness check, no
// keepalive and a call deadline far off.
absl::StatusOr<std::unique_ptr<ExpertGroupClient>> LivenessCheckedClient(int port) {
  ExpertGroupClientOptions options;
  options.group_id = kGroup;
  options.addresses = {absl::StrCat("127.0.0.1:", port)};
  options.deadline = std::chrono::seconds(20);
  options.liveness_check = std::chrono::milliseconds(200);
  return ExpertGroupClient::Create(options);
}

// A group that stops answering with its connection open (the relay holds
// every byte): no keepalive here, and the call's deadline is far off, so only
// the liveness check ends the call, UNAVAILABLE naming the group. Once the
// relay carries again the next call is answered, equal to the local group.
TEST_F(ExpertServiceTest, TheLivenessCheckFailsTheCallsOfAGroupThatStoppedAnswering) {
  SlowRelay relay(server_->port(), std::chrono::milliseconds(0));
  auto client = LivenessCheckedClient(relay.port());
  ASSERT_TRUE(client.ok()) << client.status();
  const at::Tensor a = at::randn({4, kD});
  const v1::ExpertForwardRequest request = MakeRequest(1, {{3, a}});
  const auto forward = [&](v1::ExpertForwardResponse* response) {
    std::promise<absl::Status> done;
    (*client)->ForwardAsync(&request, response, [&](absl::Status s) { done.set_value(s); });
    return done.get_future().get();
  };
  v1::ExpertForwardResponse response;
  ASSERT_TRUE(forward(&response).ok());  // connected

  relay.Hold(true);
  const absl::Status stalled = forward(&response);
  EXPECT_EQ(stalled.code(), absl::StatusCode::kUnavailable) << stalled;
  EXPECT_THAT(stalled.message(), HasSubstr("expert group 1 unreachable"));
  EXPECT_THAT(stalled.message(), HasSubstr("no answer to a health check"));
  EXPECT_EQ((*client)->calls_failed_by_liveness_check(), 1);
  // Its connection is up, yet it does not answer: no clean-up waits on it.
  EXPECT_FALSE((*client)->Connected());

  relay.Hold(false);
  const absl::Status again = forward(&response);
  ASSERT_TRUE(again.ok()) << again;
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_LE(MaxAbsDiff(Decode(response.outputs(0).rows()), LocalForward(*LocalGroup(1), 3, a)),
            1e-6);
  EXPECT_EQ((*client)->calls_failed_by_liveness_check(), 1);
  EXPECT_TRUE((*client)->Connected());
}

// A request too large for the socket buffers, sent while the relay holds
// every byte: gRPC cannot give the call back, cancelled or past its deadline,
// while its bytes are stuck in the connection's write. The liveness check
// reports it anyway; the late completion, once the relay carries again, is
// dropped, and the client is destroyed only after it.
TEST_F(ExpertServiceTest, TheLivenessCheckReportsACallStuckBehindAStalledWrite) {
  SlowRelay relay(server_->port(), std::chrono::milliseconds(0));
  auto client = LivenessCheckedClient(relay.port());
  ASSERT_TRUE(client.ok()) << client.status();
  v1::ExpertForwardResponse response;
  {
    std::promise<absl::Status> done;
    const v1::ExpertForwardRequest small = MakeRequest(1, {{3, at::randn({4, kD})}});
    (*client)->ForwardAsync(&small, &response, [&](absl::Status s) { done.set_value(s); });
    ASSERT_TRUE(done.get_future().get().ok());  // connected
  }
  relay.Hold(true);
  // 25 MB: more than loopback's socket buffers hold.
  const v1::ExpertForwardRequest big = MakeRequest(1, {{3, at::randn({400000, kD})}});
  response.Clear();
  std::promise<absl::Status> done;
  std::future<absl::Status> reported = done.get_future();
  (*client)->ForwardAsync(&big, &response, [&](absl::Status s) { done.set_value(s); });
  // Without the report the call would come back only when the relay carries.
  const bool in_time = reported.wait_for(std::chrono::seconds(15)) == std::future_status::ready;
  relay.Hold(false);
  ASSERT_TRUE(in_time) << "the stalled call was not reported";
  const absl::Status stalled = reported.get();
  EXPECT_EQ(stalled.code(), absl::StatusCode::kUnavailable) << stalled;
  EXPECT_THAT(stalled.message(), HasSubstr("expert group 1 unreachable"));
  EXPECT_THAT(stalled.message(), HasSubstr("no answer to a health check"));
  client->reset();  // waits for gRPC to give the call back
  EXPECT_EQ(response.outputs_size(), 0);
}

// A group that answers its health checks keeps a call that takes many
// liveness periods: the check fails only what does not answer.
TEST(LivenessCheckTest, ASlowCallToAGroupThatAnswersIsNotFailed) {
  class SlowForward : public v1::ExpertService::CallbackService {
   public:
    ~SlowForward() override {
      for (std::thread& t : answers_) t.join();
    }
    grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                      const v1::ExpertForwardRequest*,
                                      v1::ExpertForwardResponse* response) override {
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      std::lock_guard<std::mutex> lock(mu_);
      answers_.emplace_back([reactor, response] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1000));
        response->set_weights_fingerprint("slow");
        reactor->Finish(grpc::Status::OK);
      });
      return reactor;
    }

   private:
    std::mutex mu_;
    std::vector<std::thread> answers_;
  };
  SlowForward service;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  ExpertGroupClientOptions options;
  options.group_id = kGroup;
  options.addresses = {absl::StrCat("127.0.0.1:", port)};
  options.liveness_check = std::chrono::milliseconds(100);
  auto client = ExpertGroupClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ExpertForwardRequest request;
  v1::ExpertForwardResponse response;
  std::promise<absl::Status> done;
  (*client)->ForwardAsync(&request, &response, [&](absl::Status s) { done.set_value(s); });
  const absl::Status status = done.get_future().get();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(response.weights_fingerprint(), "slow");
  EXPECT_EQ((*client)->calls_failed_by_liveness_check(), 0);
  client->reset();
  server->Shutdown();
}

TEST(FanOutTest, WaitsForEveryCallAndReturnsTheFirstError) {
  int started = 0;
  EXPECT_TRUE(FanOut(0, [&](size_t, ExpertGroupClient::Done) { ++started; }).ok());
  EXPECT_EQ(started, 0);

  EXPECT_TRUE(FanOut(3, [](size_t, ExpertGroupClient::Done done) {
                done(absl::OkStatus());
              }).ok());

  // Completions in call order: the first error to arrive wins.
  const absl::Status first = FanOut(4, [](size_t i, ExpertGroupClient::Done done) {
    done(i == 1   ? absl::UnavailableError("call 1")
         : i == 3 ? absl::InternalError("call 3")
                  : absl::OkStatus());
  });
  EXPECT_EQ(first, absl::UnavailableError("call 1"));

  // Completions on other threads: FanOut returns once all of them are done.
  std::vector<std::thread> threads;
  std::atomic<int> finished{0};
  const absl::Status late = FanOut(3, [&](size_t i, ExpertGroupClient::Done done) {
    threads.emplace_back([&finished, i, done = std::move(done)] {
      finished.fetch_add(1);
      done(i == 2 ? absl::DeadlineExceededError("call 2") : absl::OkStatus());
    });
  });
  EXPECT_EQ(finished.load(), 3);
  EXPECT_EQ(late, absl::DeadlineExceededError("call 2"));
  for (std::thread& t : threads) t.join();
}

// --- The real binary ----------------------------------------------------------

// Kills and reaps the child in every path out of the test.
class ChildProcess {
 public:
  ~ChildProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // With `output`, stdout and stderr go to that file, and glog to stderr.
  bool Spawn(const std::vector<std::string>& args, const std::string& output = "") {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::vector<char*> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (output.empty() || !absl::StartsWith(*e, "GLOG_")) env.push_back(*e);
    }
    env.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (!output.empty()) {
      posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, output.c_str(),
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    }
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), env.data());
    posix_spawn_file_actions_destroy(&actions);
    return rc == 0;
  }
  // Reaps the child if it has exited; returns its wait status.
  std::optional<int> TryWait() {
    int status = 0;
    if (pid_ > 0 && waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return status;
    }
    return std::nullopt;
  }
  // Waits for the exit until `give_up` (so that a hung child fails the test).
  std::optional<int> WaitUntil(std::chrono::steady_clock::time_point give_up) {
    std::optional<int> exited;
    while (!exited && std::chrono::steady_clock::now() < give_up) {
      exited = TryWait();
      if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return exited;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
};

struct Finished {
  std::optional<int> status;  // wait status; none if it did not exit
  std::string output;         // stdout and stderr
};

// Runs himoe-expert with `args` to its exit.
Finished RunExpertBinary(const std::vector<std::string>& args) {
  static int runs = 0;
  const std::string output = ::testing::TempDir() + "/expert_output_" +
                             std::to_string(getpid()) + "_" + std::to_string(runs++);
  std::vector<std::string> argv = {HIMOE_EXPERT_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  Finished finished;
  ChildProcess child;
  EXPECT_TRUE(child.Spawn(argv, output));
  finished.status = child.WaitUntil(std::chrono::steady_clock::now() + std::chrono::seconds(120));
  std::ifstream in(output);
  finished.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::remove(output.c_str());
  return finished;
}

TEST(ExpertBinaryTest, HelpListsItsOwnFlags) {
  const Finished run = RunExpertBinary({"--help"});
  ASSERT_TRUE(run.status.has_value()) << "himoe-expert --help did not exit";
  EXPECT_TRUE(WIFEXITED(*run.status)) << "wait status " << *run.status;
  EXPECT_THAT(run.output, HasSubstr("Serves one expert group of a Hi-MoE model over gRPC."));
  for (const char* flag : {"--address", "--group_id", "--num_groups", "--num_experts",
                           "--seed", "--dtype", "--port_file", "--metrics_port"}) {
    EXPECT_THAT(run.output, HasSubstr(flag));
  }
  EXPECT_THAT(run.output, HasSubstr("default: \"0.0.0.0:50051\""));
  EXPECT_THAT(run.output, Not(HasSubstr("No flags matched")));
  EXPECT_THAT(run.output, Not(HasSubstr("--port (")));  // --address holds the port
}

TEST(ExpertBinaryTest, AddressWithoutPortIsRefused) {
  const Finished run = RunExpertBinary({"--address=127.0.0.1", "--threads=1"});
  ASSERT_TRUE(run.status.has_value()) << "himoe-expert did not exit";
  ASSERT_TRUE(WIFEXITED(*run.status)) << "wait status " << *run.status;
  EXPECT_EQ(WEXITSTATUS(*run.status), 1);
  EXPECT_THAT(run.output, HasSubstr("--address: '127.0.0.1' is not host:port"));

  const Finished port = RunExpertBinary({"--port=0"});
  ASSERT_TRUE(port.status.has_value());
  EXPECT_NE(*port.status, 0);
  EXPECT_THAT(port.output, HasSubstr("Unknown command line flag 'port'"));
}

TEST(ExpertBinaryTest, ServesUntilSigterm) {
  const std::string dir = ::testing::TempDir();
  const std::string tag = std::to_string(getpid());
  const std::string port_file = dir + "/expert_port_" + tag;
  const std::string state_file = dir + "/expert_bin_state_" + tag + ".bin";
  std::remove(port_file.c_str());
  auto seeded = ExpertServiceCore::Create(CoreOptions(/*seed=*/7));
  ASSERT_TRUE(seeded.ok());
  ASSERT_TRUE(SaveStateToFile(**seeded, state_file, 1000).ok());

  ChildProcess child;
  ASSERT_TRUE(child.Spawn({HIMOE_EXPERT_BINARY, "--address=127.0.0.1:0",
                           "--port_file=" + port_file, "--group_id=1", "--num_groups=4",
                           "--num_experts=8", "--num_layers=2", "--d_model=16",
                           "--d_ff=32", "--seed=42", "--threads=1",
                           "--state_file=" + state_file}));
  // Generous bound so a hung child fails the test instead of hanging it.
  int port = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (port == 0 && std::chrono::steady_clock::now() < give_up) {
    std::ifstream in(port_file);
    if (!(in >> port)) port = 0;
    if (port == 0) {
      if (auto exited = child.TryWait()) FAIL() << "himoe-expert exited early: " << *exited;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ASSERT_GT(port, 0) << "no port file from himoe-expert";

  auto stub = v1::ExpertService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    v1::ExpertInfoResponse info;
    const grpc::Status status = stub->Info(&context, v1::ExpertInfoRequest(), &info);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(info.group_id(), 1);
    EXPECT_THAT(info.expert_ids(), ElementsAre(2, 3));
    EXPECT_THAT(info.layers(), ElementsAre(0, 1));
  }
  {
    // The state file (seed 7) replaced the seed-42 weights.
    const at::Tensor rows = at::randn({3, kD});
    grpc::ClientContext context;
    v1::ExpertForwardResponse response;
    ASSERT_TRUE(stub->Forward(&context, MakeRequest(0, {{3, rows}}), &response).ok());
    EXPECT_LE(MaxAbsDiff(Decode(response.outputs(0).rows()),
                         LocalForward(*LocalGroup(0, 7), 3, rows)),
              1e-6);
  }

  // An idle client channel only notices the server's GOAWAY on its next poll
  // (up to 5 s), which is as long as a graceful shutdown then waits: close it.
  stub.reset();
  ASSERT_EQ(kill(child.pid(), SIGTERM), 0);
  const std::optional<int> exited = child.WaitUntil(give_up + std::chrono::seconds(60));
  ASSERT_TRUE(exited.has_value()) << "himoe-expert did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(*exited)) << "wait status " << *exited;
  EXPECT_EQ(WEXITSTATUS(*exited), 0);
  std::remove(port_file.c_str());
  std::remove(state_file.c_str());
}

}  // namespace
}  // namespace himoe::expert
