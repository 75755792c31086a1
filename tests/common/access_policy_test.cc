#include "common/access_policy.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;

const std::vector<std::string> kMethods = {"/pkg.S/Info", "/pkg.S/Forward", "/pkg.S/Step",
                                           "/pkg.S/BeginRun"};

Caller With(std::vector<std::string> principals) {
  Caller c;
  c.authenticated = true;
  c.principals = std::move(principals);
  return c;
}

std::shared_ptr<const AccessPolicy> Parse(const std::string& json) {
  auto policy = AccessPolicy::Parse(json, "test.json", kMethods);
  EXPECT_TRUE(policy.ok()) << policy.status();
  return policy.ok() ? *policy : nullptr;
}

// Deny before allow; no rule, no call; sources and paths as gRPC's policy
// reads them ("*" any, a trailing '*' a prefix; no source: every caller).
TEST(AccessPolicyTest, DecidesAsGrpcsPolicyReads) {
  const auto policy = Parse(R"({
    "name": "p",
    "deny_rules": [{"name": "no-mallory", "source": {"principals": ["spiffe://x/mallory"]}}],
    "allow_rules": [
      {"name": "trainer", "source": {"principals": ["spiffe://x/trainer"]}},
      {"name": "routers", "source": {"principals": ["spiffe://x/router-*"]},
       "request": {"paths": ["/pkg.S/Forward", "/pkg.S/Info"]}},
      {"name": "anyone-info", "request": {"paths": ["/pkg.S/Info"]}},
      {"name": "any-cert-forward", "source": {"principals": ["*"]},
       "request": {"paths": ["/pkg.S/For*"]}}
    ]})");
  ASSERT_NE(policy, nullptr);
  EXPECT_EQ(policy->name(), "p");
  const Caller trainer = With({"spiffe://x/trainer"});
  const Caller router = With({"spiffe://x/router-eu", "router.example"});
  const Caller other = With({"spiffe://x/someone"});
  const Caller mallory = With({"spiffe://x/trainer", "spiffe://x/mallory"});
  const Caller anonymous;
  struct Case {
    const Caller* caller;
    std::string path;
    bool allowed;
  };
  for (const Case& c : std::vector<Case>{
           {&trainer, "/pkg.S/Step", true},
           {&trainer, "/pkg.S/BeginRun", true},
           {&router, "/pkg.S/Forward", true},
           {&router, "/pkg.S/Step", false},
           {&other, "/pkg.S/Forward", true},  // any certificate
           {&other, "/pkg.S/BeginRun", false},
           {&anonymous, "/pkg.S/Info", true},  // no source: every caller
           {&anonymous, "/pkg.S/Forward", false},
           {&mallory, "/pkg.S/Step", false},  // deny wins over allow
           {&mallory, "/pkg.S/Info", false},
       }) {
    const absl::Status s = policy->Check(c.path, *c.caller);
    EXPECT_EQ(s.ok(), c.allowed) << c.path << " " << s;
    if (!c.allowed) EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  }
  const absl::Status denied = policy->Check("/pkg.S/Step", router);
  EXPECT_THAT(std::string(denied.message()),
              HasSubstr("/pkg.S/Step: caller [spiffe://x/router-eu, router.example] may not call "
                        "it under authorization policy 'p' (no allow rule matches)"));
  EXPECT_THAT(std::string(policy->Check("/pkg.S/Step", mallory).message()),
              HasSubstr("deny rule 'no-mallory'"));
  EXPECT_THAT(std::string(policy->Check("/pkg.S/Forward", anonymous).message()),
              HasSubstr("an unauthenticated caller (no client certificate)"));
}

// What is wrong with a policy file is said at start, naming the field.
TEST(AccessPolicyTest, ABadPolicyIsRefusedNamingTheField) {
  struct Case {
    std::string json;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"{", "authorization policy test.json: not JSON"},
           {"[]", "test.json: expected an object"},
           {R"({"allow_rules": [{"name": "a"}]})", "test.json: name: missing"},
           {R"({"name": "p"})", "allow_rules: missing"},
           {R"({"name": "p", "allow_rules": []})",
            "allow_rules: expected a non-empty array of rules"},
           {R"({"name": "p", "allow_rules": [{"name": "a"}], "audit": 1})",
            "audit: unknown key; expected one of name, deny_rules, allow_rules"},
           {R"({"name": "p", "allow_rules": [{"source": {"principals": ["x"]}}]})",
            "allow_rules[0].name: missing"},
           {R"({"name": "p", "allow_rules": [{"name": "a", "source": {"principals": []}}]})",
            "allow_rules[0].source.principals: expected a non-empty array of strings"},
           {R"({"name": "p", "allow_rules": [{"name": "a", "source": {"principals": [7]}}]})",
            "allow_rules[0].source.principals[0]: expected a non-empty string"},
           {R"({"name": "p", "allow_rules": [{"name": "a", "request": {"headers": []}}]})",
            "allow_rules[0].request.headers: unknown key; expected one of paths"},
           {R"({"name": "p", "allow_rules": [{"name": "a"}],
                "deny_rules": [{"name": "d", "request": {"paths": ["/pkg.S/Stepp"]}}]})",
            "deny_rules[0].request.paths[0]: '/pkg.S/Stepp' names no method of this service; "
            "expected one of /pkg.S/Info, /pkg.S/Forward, /pkg.S/Step, /pkg.S/BeginRun"},
       }) {
    const auto policy = AccessPolicy::Parse(c.json, "test.json", kMethods);
    ASSERT_FALSE(policy.ok()) << c.json;
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(policy.status().message()), HasSubstr(c.message)) << c.json;
  }
  // A prefix that matches a method is a path.
  EXPECT_TRUE(
      AccessPolicy::Parse(
          R"({"name": "p", "allow_rules": [{"name": "a", "request": {"paths": ["/pkg.S/*"]}}]})",
          "test.json", kMethods)
          .ok());
}

TEST(AccessPolicyTest, AFileIsReadAndAMissingOneNamed) {
  test_util::TempDir dir("himoe_access_policy_test");
  const std::string path = dir.Sub("policy.json");
  test_util::WriteTextFile(path, R"({"name": "from-file", "allow_rules": [
      {"name": "a", "request": {"paths": ["/pkg.S/Info"]}}]})");
  const auto policy = AccessPolicy::FromFile(path, kMethods);
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_TRUE((*policy)->Check("/pkg.S/Info", Caller()).ok());
  EXPECT_FALSE((*policy)->Check("/pkg.S/Step", Caller()).ok());
  const auto missing = AccessPolicy::FromFile(dir.Sub("none.json"), kMethods);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(dir.Sub("none.json")));
}

}  // namespace
}  // namespace himoe
