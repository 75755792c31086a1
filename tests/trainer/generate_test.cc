// Generate: a trained checkpoint served through 4 expert-group services (and
// over the router's gRPC stream, on the router's own MoE layers) samples
// exactly what the in-process reference samples; sampling is deterministic
// per seed; greedy decoding is the argmax of the model's next-token logits.
#include "model/generator.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include "common/linear.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "himoe/v1/router.grpc.pb.h"
#include "model/checkpoint_reader.h"
#include "model/model_config.h"
#include "router_service/router_grpc_service.h"
#include "tests/trainer/trainer_test_util.h"
#include "tests/rowwise_rows_test.h"
#include "trainer/backend_moe.h"
#include "trainer/checkpoint.h"
#include "trainer/expert_backend.h"
#include "trainer/trainer.h"

namespace himoe::trainer {
namespace {

using model::Generator;
using ::testing::HasSubstr;
using testing::ExpertCluster;
using TempDir = testing::TempDir;

constexpr int kTrainSteps = 60;

TrainerOptions TinyOptions(const std::string& corpus) {
  TrainerOptions o;
  o.model.n_layer = 2;
  o.model.n_head = 3;  // 16 wide: decoding attention in the project's loops
  o.model.d_model = 48;
  o.model.d_ff = 64;
  o.model.dense_ff = 96;
  o.model.block_size = 32;
  o.model.routing.method = router::RoutingMethod::kHiMoe;
  o.model.routing.num_experts = 8;
  o.model.routing.num_groups = 4;
  o.model.routing.top_k = 1;
  o.model.routing.tau = 0.1;
  o.model.seed = 3;
  o.data.paths = {corpus};
  o.steps = kTrainSteps;
  o.batch_size = 8;
  o.lr = 1e-2;
  o.warmup_steps = 5;
  o.eval_windows = 4;
  o.seed = 11;
  return o;
}

// One model, checkpointed untrained (step 0) and after kTrainSteps steps;
// built once for every test (training is the slow part).
struct Checkpoints {
  TempDir dir{"himoe_generate_test"};
  TrainerOptions options;
  std::string untrained, trained;  // checkpoint roots
};

const Checkpoints& Trained() {
  // Destroyed at exit, which removes the directory.
  static const std::unique_ptr<Checkpoints> c = [] {
    auto c = std::make_unique<Checkpoints>();
    c->options = TinyOptions(testing::WriteCorpus(c->dir));
    c->untrained = c->dir.Sub("untrained");
    c->trained = c->dir.Sub("trained");
    auto trainer = Trainer::Create(c->options);
    EXPECT_TRUE(trainer.ok()) << trainer.status();
    if (!trainer.ok()) return c;
    EXPECT_TRUE(SaveCheckpoint(**trainer, c->untrained, 1).ok());
    for (int i = 0; i < kTrainSteps; ++i) {
      auto r = (*trainer)->Step();
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return c;
    }
    EXPECT_TRUE(SaveCheckpoint(**trainer, c->trained, 1).ok());
    return c;
  }();
  return *c;
}

// A checkpoint's Generator over BackendMoE on an expert backend: in this
// process, or on the services at `addresses`. The returned pointer owns the
// backend and the MoE layers too.
std::shared_ptr<Generator> MakeGenerator(const std::string& checkpoint,
                                         const std::vector<std::string>& addresses = {},
                                         bool load_expert_state = true,
                                         model::GeneratorOptions go = {}) {
  struct Stack {
    std::unique_ptr<ExpertBackend> experts;
    std::unique_ptr<BackendMoE> moe;
    std::unique_ptr<Generator> generator;
  };
  auto stack = std::make_shared<Stack>();
  const absl::Status built = [&]() -> absl::Status {
    HIMOE_ASSIGN_OR_RETURN(const model::CheckpointContents contents,
                           model::ReadCheckpoint(checkpoint));
    ExpertBackendOptions eo;
    eo.shape = model::ExpertShapeFor(contents.model);
    eo.addresses = addresses;
    if (addresses.empty()) {
      HIMOE_ASSIGN_OR_RETURN(stack->experts, CreateInProcessBackend(eo));
    } else {
      HIMOE_ASSIGN_OR_RETURN(stack->experts, CreateRemoteBackend(eo));
    }
    HIMOE_ASSIGN_OR_RETURN(stack->moe, BackendMoE::Create(contents.model, stack->experts.get()));
    go.load_expert_state = load_expert_state;
    go.max_new_tokens_limit = 512;
    HIMOE_ASSIGN_OR_RETURN(stack->generator,
                           Generator::Create(contents, stack->moe.get(), go));
    return absl::OkStatus();
  }();
  EXPECT_TRUE(built.ok()) << built;
  if (!built.ok()) return nullptr;
  return std::shared_ptr<Generator>(stack, stack->generator.get());
}

std::vector<int64_t> Bytes(const std::string& s) {
  std::vector<int64_t> out;
  for (const char c : s) out.push_back(static_cast<unsigned char>(c));
  return out;
}

model::GenerateParams Params(const std::string& prompt, int n, double temperature, int top_k,
                              uint64_t seed) {
  model::GenerateParams p;
  p.prompt = Bytes(prompt);
  p.max_new_tokens = n;
  p.temperature = temperature;
  p.top_k = top_k;
  p.seed = seed;
  return p;
}

std::vector<int64_t> Sample(Generator& g, const model::GenerateParams& p) {
  std::vector<int64_t> tokens;
  const absl::Status s = g.Generate(p, [&](int64_t t) {
    tokens.push_back(t);
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  return tokens;
}

double PrintableShare(const std::vector<int64_t>& tokens) {
  const auto n = std::count_if(tokens.begin(), tokens.end(), [](int64_t t) {
    return (t >= 32 && t < 127) || t == '\n';
  });
  return tokens.empty() ? 0 : static_cast<double>(n) / tokens.size();
}

TEST(GenerateTest, CheckpointCarriesTheModelAsTrained) {
  const Checkpoints& c = Trained();
  auto contents = model::ReadCheckpoint(c.trained);  // the root: its newest checkpoint
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->step, kTrainSteps);
  EXPECT_EQ(contents->model.d_model, 48);
  EXPECT_EQ(contents->model.block_size, 32);
  EXPECT_EQ(contents->model.routing.method, router::RoutingMethod::kHiMoe);
  EXPECT_DOUBLE_EQ(contents->model.routing.tau, 0.1);
  EXPECT_EQ(contents->model.seed, 3u);
  EXPECT_EQ(contents->experts.size(), 4u);
}

TEST(GenerateTest, ThroughTheClusterEqualsInProcess) {
  const Checkpoints& c = Trained();
  ExpertCluster cluster(c.options);
  auto remote = MakeGenerator(c.trained, cluster.addresses());
  auto reference = MakeGenerator(c.trained);
  ASSERT_NE(remote, nullptr);
  ASSERT_NE(reference, nullptr);

  auto a = remote->NextTokenLogits(Bytes("The expert "));
  auto b = reference->NextTokenLogits(Bytes("The expert "));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LE((*a - *b).abs().max().item<double>(), 1e-4);

  const auto p = Params("The expert ", 64, 0.8, 20, 7);
  EXPECT_EQ(Sample(*remote, p), Sample(*reference, p));
}

TEST(GenerateTest, ExpertWeightsArePushedToTheGroups) {
  const Checkpoints& c = Trained();
  ExpertCluster cluster(c.options);  // fresh services: the seed's initial experts
  auto stale = MakeGenerator(c.trained, cluster.addresses(), /*load_expert_state=*/false);
  ASSERT_NE(stale, nullptr);
  auto stale_logits = stale->NextTokenLogits(Bytes("The expert "));
  auto loaded = MakeGenerator(c.trained, cluster.addresses());
  auto reference = MakeGenerator(c.trained);
  ASSERT_NE(loaded, nullptr);
  ASSERT_NE(reference, nullptr);
  auto loaded_logits = loaded->NextTokenLogits(Bytes("The expert "));
  auto reference_logits = reference->NextTokenLogits(Bytes("The expert "));
  ASSERT_TRUE(stale_logits.ok() && loaded_logits.ok() && reference_logits.ok());
  // The trained experts matter, and they reach the services only with SetState.
  EXPECT_GT((*stale_logits - *reference_logits).abs().max().item<double>(), 1e-3);
  EXPECT_LE((*loaded_logits - *reference_logits).abs().max().item<double>(), 1e-4);
}

TEST(GenerateTest, FixedSeedIsDeterministic) {
  auto g = MakeGenerator(Trained().trained);
  ASSERT_NE(g, nullptr);
  const auto first = Sample(*g, Params("Every ", 64, 1.0, 0, 42));
  EXPECT_EQ(first.size(), 64u);
  EXPECT_EQ(Sample(*g, Params("Every ", 64, 1.0, 0, 42)), first);
  EXPECT_NE(Sample(*g, Params("Every ", 64, 1.0, 0, 43)), first);
}

// Greedy: each token is the argmax of the logits of its own prefix, cropped
// to the last block_size (32) tokens; top-1 sampling is greedy too.
TEST(GenerateTest, GreedyIsTheArgmaxOfEachPrefix) {
  auto g = MakeGenerator(Trained().trained);
  ASSERT_NE(g, nullptr);
  const std::string prompt = "The router ";
  const auto greedy = Sample(*g, Params(prompt, 40, 0.0, 0, 1));  // 11 + 40 > 32: cropped
  ASSERT_EQ(greedy.size(), 40u);
  std::vector<int64_t> context = Bytes(prompt);
  for (size_t i = 0; i < greedy.size(); ++i) {
    const std::vector<int64_t> window(context.end() - std::min<size_t>(context.size(), 32),
                                      context.end());
    auto logits = g->NextTokenLogits(window);
    ASSERT_TRUE(logits.ok());
    EXPECT_EQ(logits->argmax().item<int64_t>(), greedy[i]) << "token " << i;
    context.push_back(greedy[i]);
  }
  EXPECT_EQ(Sample(*g, Params(prompt, 40, 1.0, 1, 99)), greedy);
  // The limit T -> 0 is greedy, down to the smallest temperatures a float
  // holds, where logits / T overflows (found by the Generate fuzz target:
  // such a request failed).
  for (const double tiny : {1e-30, 4.5e-37, 1e-45}) {
    EXPECT_EQ(Sample(*g, Params(prompt, 40, tiny, 0, 7)), greedy) << "temperature " << tiny;
  }
}

model::GeneratorOptions NoKvCache() {
  model::GeneratorOptions go;
  go.kv_cache = false;
  return go;
}

// Sampled, top-k and greedy runs of 60 tokens from `checkpoint` (past the
// block size of 32, where the window is recomputed), with the KV cache and
// with full recompute of every context: the same tokens.
void ExpectKvCacheSamplesWhatFullRecomputeSamples(const std::string& checkpoint) {
  auto cached = MakeGenerator(checkpoint);
  auto full = MakeGenerator(checkpoint, {}, true, NoKvCache());
  ASSERT_NE(cached, nullptr);
  ASSERT_NE(full, nullptr);
  for (const auto& p : {Params("The ", 60, 1.0, 0, 5), Params("a", 60, 0.8, 5, 6),
                        Params("The router ", 60, 0.0, 0, 7)}) {
    EXPECT_EQ(Sample(*cached, p), Sample(*full, p)) << "seed " << p.seed;
  }
}

// The KV cache changes no token of the trained model (its heads 16 wide:
// the project's decoding loops).
TEST(GenerateTest, TheKvCacheSamplesWhatFullRecomputeSamples) {
  ExpectKvCacheSamplesWhatFullRecomputeSamples(Trained().trained);
}

// Heads 24 wide (or on a GPU) a decoding step attends through one gather of
// the cached keys and values, masked to each stream's length: its tokens
// equal full recompute too (an untrained model; its draws are as sensitive
// to the logits as a trained one's).
TEST(GenerateTest, TheGatherPathSamplesWhatFullRecomputeSamples) {
  TempDir dir("himoe_generate_gather");
  TrainerOptions o = TinyOptions(testing::WriteCorpus(dir));
  o.model.n_head = 2;
  auto trainer = Trainer::Create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const std::string checkpoint = dir.Sub("untrained");
  ASSERT_TRUE(SaveCheckpoint(**trainer, checkpoint, 1).ok());
  ExpectKvCacheSamplesWhatFullRecomputeSamples(checkpoint);
}

// Concurrent streams are decoded together (fewer steps than tokens) and each
// samples exactly what it samples alone, with the few-row products (the
// router's and the experts') as BLAS GEMMs and through the small-rows loop,
// the two paths the compute set-up picks between.
class ConcurrentStreamsTest : public test_util::RowwiseRowsTest {};

INSTANTIATE_TEST_SUITE_P(ProductPaths, ConcurrentStreamsTest,
                         ::testing::Values(int64_t{0}, kRowwiseLinearRowsWhenFaster),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return info.param == 0 ? "gemm" : "small_rows";
                         });

TEST_P(ConcurrentStreamsTest, EachEqualsItsRunAlone) {
  auto g = MakeGenerator(Trained().trained);
  ASSERT_NE(g, nullptr);
  const std::vector<model::GenerateParams> params = {
      Params("The ", 40, 1.0, 0, 11), Params("Hi", 25, 0.7, 8, 12),
      Params("router", 33, 0.0, 0, 13), Params("x", 40, 1.0, 3, 14)};
  std::vector<std::vector<int64_t>> alone;
  for (const auto& p : params) alone.push_back(Sample(*g, p));
  const model::GeneratorStats before = g->stats();
  std::vector<std::vector<int64_t>> together(params.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < params.size(); ++i) {
    threads.emplace_back([&, i] {
      const absl::Status s = g->Generate(params[i], [&, i](int64_t t) {
        // A stream's first token waits until every stream has joined: the
        // first step holds, and the next decodes all of them.
        if (together[i].empty()) {
          for (int w = 0; w < 3000 && g->stats().active_streams < 4; ++w) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
        together[i].push_back(t);
        return true;
      });
      EXPECT_TRUE(s.ok()) << s;
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(together[i], alone[i]) << "stream " << i;
  const model::GeneratorStats after = g->stats();
  EXPECT_EQ(after.tokens - before.tokens, 40 + 25 + 33 + 40);
  // Every stream is in step 1 or 2, so the last ends by step 2 + 40 - 1:
  // 138 tokens in at most 41 steps.
  EXPECT_LE(after.steps - before.steps, 41);
  EXPECT_EQ(after.active_streams, 0);
}

// Beyond max_streams a request is refused at once; a cancelled stream leaves.
TEST(GenerateTest, StreamsBeyondTheLimitAreRefusedAndCancelledOnesLeave) {
  model::GeneratorOptions go;
  go.max_streams = 1;
  auto g = MakeGenerator(Trained().trained, {}, true, go);
  ASSERT_NE(g, nullptr);
  absl::Status refused;
  int tokens = 0;
  int64_t slots_while_decoding = -1;
  const absl::Status cancelled = g->Generate(Params("The ", 50, 1.0, 0, 1), [&](int64_t) {
    if (++tokens == 2) {
      refused = g->Generate(Params("x", 5, 1.0, 0, 2), [](int64_t) { return true; });
      slots_while_decoding = g->stats().kv_cache_slots;  // as of the end of step 1
    }
    return tokens < 3;
  });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(), "generate: 1 streams are decoding (max_streams = 1); retry later");
  EXPECT_EQ(cancelled.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(tokens, 3);
  EXPECT_EQ(g->stats().rejected, 1);
  EXPECT_EQ(g->stats().active_streams, 0);
  // The cancelled stream's KV cache went back to the pool.
  EXPECT_EQ(slots_while_decoding, 1);
  EXPECT_EQ(g->stats().kv_cache_slots, 0);
  EXPECT_EQ(Sample(*g, Params("x", 5, 1.0, 0, 2)).size(), 5u);  // serving goes on
}

TEST(GenerateTest, TrainedModelWritesText) {
  const Checkpoints& c = Trained();
  auto trained = MakeGenerator(c.trained);
  auto untrained = MakeGenerator(c.untrained);
  ASSERT_NE(trained, nullptr);
  ASSERT_NE(untrained, nullptr);
  const auto p = Params("The ", 256, 1.0, 0, 5);
  const double trained_share = PrintableShare(Sample(*trained, p));
  const double untrained_share = PrintableShare(Sample(*untrained, p));
  // The corpus is printable ASCII and newlines; an untrained byte model draws
  // nearly uniformly over 256 bytes (96/256 = 0.375 printable).
  EXPECT_GT(trained_share, 0.95);
  EXPECT_LT(untrained_share, 0.7);
}

// --- Over gRPC: RouterServer streaming Generate.

class RouterGenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Checkpoints& c = Trained();
    cluster_ = std::make_unique<ExpertCluster>(c.options);
    reference_ = MakeGenerator(c.trained);
    ASSERT_NE(reference_, nullptr);
    auto contents = model::ReadCheckpoint(c.trained);
    ASSERT_TRUE(contents.ok()) << contents.status();
    router::RouterServerOptions o;
    o.moe.routing = c.options.model.routing;
    o.moe.shape = model::ExpertShapeFor(c.options.model);
    for (int g = 0; g < 4; ++g) {
      expert::ExpertGroupClientOptions go;
      go.group_id = g;
      go.addresses = {cluster_->addresses()[g]};
      o.moe.groups.push_back(go);
    }
    // As himoe-router --checkpoint: the LM on the router's own MoE layers.
    o.make_generator = [contents = std::make_shared<const model::CheckpointContents>(
                            *std::move(contents))](model::MoELayers& moe)
        -> absl::StatusOr<std::shared_ptr<model::TextGenerator>> {
      model::GeneratorOptions go;
      go.max_new_tokens_limit = 512;
      HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<Generator> generator,
                             Generator::Create(*contents, &moe, go));
      return std::shared_ptr<model::TextGenerator>(std::move(generator));
    };
    auto server = router::RouterServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    ASSERT_NE(server_->generator(), nullptr);
    o.make_generator = nullptr;
    auto plain = router::RouterServer::Start(o);
    ASSERT_TRUE(plain.ok()) << plain.status();
    plain_ = std::move(plain).value();
  }

  static std::unique_ptr<v1::RouterService::Stub> Stub(int port) {
    return v1::RouterService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }

  // Reads the whole stream: the tokens, the concatenated text, the status,
  // and the trailing "himoe-finish-reason" when `finish_reason` is given.
  static grpc::Status Call(v1::RouterService::Stub& stub, const v1::GenerateRequest& request,
                           std::vector<int64_t>* tokens, std::string* text,
                           std::string* finish_reason = nullptr) {
    grpc::ClientContext context;
    auto reader = stub.Generate(&context, request);
    v1::GenerateResponse response;
    while (reader->Read(&response)) {
      tokens->push_back(response.token());
      *text += response.text();
    }
    const grpc::Status status = reader->Finish();
    if (finish_reason != nullptr) {
      const auto& trailers = context.GetServerTrailingMetadata();
      const auto it = trailers.find("himoe-finish-reason");
      *finish_reason = it == trailers.end() ? "" : std::string(it->second.data(), it->second.size());
    }
    return status;
  }

  static v1::GenerateRequest Request(const std::string& prompt, int n, float temperature,
                                     int top_k, uint64_t seed) {
    v1::GenerateRequest r;
    r.set_prompt(prompt);
    r.set_max_new_tokens(n);
    r.set_temperature(temperature);
    r.set_top_k(top_k);
    r.set_seed(seed);
    return r;
  }

  std::unique_ptr<ExpertCluster> cluster_;
  std::shared_ptr<Generator> reference_;
  std::unique_ptr<router::RouterServer> server_, plain_;
};

TEST_F(RouterGenerateTest, StreamsTheReferenceSample) {
  auto stub = Stub(server_->port());
  std::vector<int64_t> tokens;
  std::string text;
  const grpc::Status s = Call(*stub, Request("The garden ", 48, 0.7f, 30, 2024), &tokens, &text);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // float on the wire: the reference uses the same rounded temperature.
  EXPECT_EQ(tokens, Sample(*reference_, Params("The garden ", 48, 0.7f, 30, 2024)));
  ASSERT_EQ(text.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(static_cast<unsigned char>(text[i]), tokens[i]);
  }
  // Token ids work as a prompt too, and give the same sample.
  v1::GenerateRequest by_ids = Request("", 48, 0.7f, 30, 2024);
  for (const int64_t t : Bytes("The garden ")) by_ids.add_prompt_tokens(t);
  std::vector<int64_t> again;
  std::string again_text;
  ASSERT_TRUE(Call(*stub, by_ids, &again, &again_text).ok());
  EXPECT_EQ(again, tokens);
}

// Eight concurrent gRPC streams through the router (decoded together, their
// MoE rows batched by the router) each equal the in-process reference alone.
// The odd ones stop at their first space, leaving the batch while the others
// go on: each is its reference cut before that space.
TEST_F(RouterGenerateTest, ConcurrentStreamsEachEqualTheReference) {
  constexpr int kStreams = 8;
  std::vector<std::vector<int64_t>> tokens(kStreams);
  std::vector<grpc::Status> status(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      auto stub = Stub(server_->port());
      std::string text;
      v1::GenerateRequest request = Request("The ", 24, 1.0f, 0, 100 + i);
      if (i % 2 == 1) request.add_stop_token_ids(' ');
      status[i] = Call(*stub, request, &tokens[i], &text);
    });
  }
  for (auto& t : threads) t.join();
  int64_t sampled = 0;
  int stopped_early = 0;
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(status[i].ok()) << i << ": " << status[i].error_message();
    std::vector<int64_t> want = Sample(*reference_, Params("The ", 24, 1.0f, 0, 100 + i));
    if (i % 2 == 1) {
      const auto space = std::find(want.begin(), want.end(), ' ');
      if (space != want.end()) {
        ++stopped_early;
        want.erase(space, want.end());
        sampled += 1;  // the space itself: sampled, not sent
      }
    }
    sampled += static_cast<int64_t>(want.size());
    EXPECT_EQ(tokens[i], want) << i;
  }
  EXPECT_GE(stopped_early, 2);  // the batch really changed under the others
  const model::GeneratorStats stats = server_->generator()->stats();
  EXPECT_EQ(stats.tokens, sampled);
  EXPECT_EQ(stats.active_streams, 0);
}

// himoe-router --checkpoint also routes RouteForward with the trained routers:
// the generator restored them into the router's MoE layers.
TEST_F(RouterGenerateTest, RouteForwardUsesTheTrainedRouters) {
  auto stub = Stub(server_->port());
  auto plain = Stub(plain_->port());
  const at::Tensor x = at::randn({32, 48}, at::TensorOptions().dtype(at::kFloat));
  const auto route = [&](v1::RouterService::Stub& s, int layer) {
    v1::RouteForwardRequest request;
    request.set_layer(layer);
    request.set_return_routing(true);
    EXPECT_TRUE(EncodeTensor(x, request.mutable_hidden()).ok());
    v1::RouteForwardResponse response;
    grpc::ClientContext context;
    const grpc::Status status = s.RouteForward(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    auto ids = DecodeTensor(response.expert_ids(), "expert_ids");
    EXPECT_TRUE(ids.ok());
    return ids.ok() ? *ids : at::Tensor();
  };
  for (int layer = 0; layer < 2; ++layer) {
    auto routed = reference_->router(layer).Route(x, /*training=*/false);
    ASSERT_TRUE(routed.ok());
    const at::Tensor want = routed->expert_ids;
    EXPECT_FALSE(at::equal(route(*plain, layer), want)) << "seeded gates, layer " << layer;
    EXPECT_TRUE(at::equal(route(*stub, layer), want)) << "trained gates, layer " << layer;
  }
}

// top_p and stop sequences over gRPC against the in-process reference: with
// top_p the stream is the reference's sample with the same top_p; a stop
// sequence or stop token cuts it before the stop's first occurrence (found
// here in the reference's tokens), and one that never occurs leaves it whole.
TEST_F(RouterGenerateTest, TopPAndStopSequencesFollowTheReference) {
  auto stub = Stub(server_->port());
  v1::GenerateRequest request = Request("The garden ", 64, 0.9f, 0, 77);
  request.set_top_p(0.8f);
  model::GenerateParams params = Params("The garden ", 64, 0.9f, 0, 77);
  params.top_p = 0.8f;  // float on the wire
  const std::vector<int64_t> full = Sample(*reference_, params);
  ASSERT_EQ(full.size(), 64u);
  params.top_p = 1.0;
  EXPECT_NE(Sample(*reference_, params), full) << "top_p 0.8 should change this sample";

  std::vector<int64_t> tokens;
  std::string text, reason;
  ASSERT_TRUE(Call(*stub, request, &tokens, &text, &reason).ok());
  EXPECT_EQ(tokens, full);
  EXPECT_EQ(reason, "length");

  // The first two-byte sequence from position 8 on that occurs nowhere before.
  const auto occurs_before = [&](size_t k) {
    for (size_t j = 0; j < k; ++j) {
      if (full[j] == full[k] && full[j + 1] == full[k + 1]) return true;
    }
    return false;
  };
  size_t k = 8;
  while (k + 2 < full.size() && occurs_before(k)) ++k;
  ASSERT_LT(k + 2, full.size());
  v1::GenerateRequest stop = request;
  stop.add_stop(std::string{static_cast<char>(full[k]), static_cast<char>(full[k + 1])});
  tokens.clear();
  text.clear();
  ASSERT_TRUE(Call(*stub, stop, &tokens, &text, &reason).ok());
  EXPECT_EQ(tokens, std::vector<int64_t>(full.begin(), full.begin() + k)) << "stop at " << k;
  EXPECT_EQ(reason, "stop");

  // A stop token: the stream ends before that byte's first occurrence.
  const int64_t t = full[20];
  const size_t first = std::find(full.begin(), full.end(), t) - full.begin();
  v1::GenerateRequest stop_id = request;
  stop_id.add_stop_token_ids(t);
  tokens.clear();
  text.clear();
  ASSERT_TRUE(Call(*stub, stop_id, &tokens, &text, &reason).ok());
  EXPECT_EQ(tokens, std::vector<int64_t>(full.begin(), full.begin() + first));
  EXPECT_EQ(reason, "stop");

  // Begins like the two-byte stop above, then a byte the sample never has:
  // held, then released, so the whole sample comes.
  ASSERT_EQ(std::count(full.begin(), full.end(), 1), 0);
  v1::GenerateRequest never = request;
  never.add_stop(std::string{static_cast<char>(full[k]), static_cast<char>(full[k + 1]), '\x01'});
  tokens.clear();
  text.clear();
  ASSERT_TRUE(Call(*stub, never, &tokens, &text, &reason).ok());
  EXPECT_EQ(tokens, full);
  EXPECT_EQ(reason, "length");
}

TEST_F(RouterGenerateTest, BadRequestsNameTheFieldAndServingContinues) {
  auto stub = Stub(server_->port());
  struct Case {
    v1::GenerateRequest request;
    std::string field;
  };
  std::vector<Case> cases = {
      {Request("The ", 8, -1.0f, 0, 1), "temperature"},
      {Request("The ", 8, 1.0f, 257, 1), "top_k"},
      {Request("The ", 8, 1.0f, -2, 1), "top_k"},
      {Request("The ", 0, 1.0f, 0, 1), "max_new_tokens"},
      {Request("The ", 513, 1.0f, 0, 1), "max_new_tokens"},
      {Request("", 8, 1.0f, 0, 1), "prompt"},
  };
  Case both{Request("The ", 8, 1.0f, 0, 1), "prompt_tokens"};
  both.request.add_prompt_tokens(65);
  cases.push_back(both);
  for (const float top_p : {-0.5f, 1.5f}) {
    Case c{Request("The ", 8, 1.0f, 0, 1), "top_p"};
    c.request.set_top_p(top_p);
    cases.push_back(c);
  }
  Case empty_stop{Request("The ", 8, 1.0f, 0, 1), "stop[1]"};
  empty_stop.request.add_stop("ab");
  empty_stop.request.add_stop("");
  cases.push_back(empty_stop);
  Case long_stop{Request("The ", 8, 1.0f, 0, 1), "stop[0]"};
  long_stop.request.add_stop(std::string(65, 'a'));
  cases.push_back(long_stop);
  Case bad_id{Request("The ", 8, 1.0f, 0, 1), "stop_token_ids[0]"};
  bad_id.request.add_stop_token_ids(256);
  cases.push_back(bad_id);
  Case many{Request("The ", 8, 1.0f, 0, 1), "stop, stop_token_ids"};
  for (int i = 0; i < 9; ++i) many.request.add_stop("x");
  for (int i = 0; i < 8; ++i) many.request.add_stop_token_ids(10);
  cases.push_back(many);
  Case out_of_vocab{Request("", 8, 1.0f, 0, 1), "prompt_tokens[1]"};
  out_of_vocab.request.add_prompt_tokens(65);
  out_of_vocab.request.add_prompt_tokens(256);
  cases.push_back(out_of_vocab);
  for (const Case& c : cases) {
    std::vector<int64_t> tokens;
    std::string text;
    const grpc::Status s = Call(*stub, c.request, &tokens, &text);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_THAT(s.error_message(), HasSubstr(c.field));
    EXPECT_TRUE(tokens.empty());
  }
  std::vector<int64_t> tokens;
  std::string text;
  EXPECT_TRUE(Call(*stub, Request("The ", 8, 1.0f, 0, 1), &tokens, &text).ok());
  EXPECT_EQ(tokens.size(), 8u);
}

TEST_F(RouterGenerateTest, WithoutACheckpointGenerateIsFailedPrecondition) {
  auto stub = Stub(plain_->port());
  std::vector<int64_t> tokens;
  std::string text;
  const grpc::Status s = Call(*stub, Request("The ", 8, 1.0f, 0, 1), &tokens, &text);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("--checkpoint"));
}

TEST_F(RouterGenerateTest, ClientCancellationStopsTheStream) {
  auto stub = Stub(server_->port());
  {
    grpc::ClientContext context;
    auto reader = stub->Generate(&context, Request("The ", 512, 1.0f, 0, 3));
    v1::GenerateResponse response;
    int read = 0;
    while (read < 3 && reader->Read(&response)) ++read;
    EXPECT_EQ(read, 3);
    context.TryCancel();
    while (reader->Read(&response)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // The generator is free again: the next request is served in full.
  std::vector<int64_t> tokens;
  std::string text;
  EXPECT_TRUE(Call(*stub, Request("The ", 16, 1.0f, 0, 3), &tokens, &text).ok());
  EXPECT_EQ(tokens.size(), 16u);
}

}  // namespace
}  // namespace himoe::trainer
