#include "common/host_port.h"

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;

TEST(HostPortTest, ParsesIpv4NamesAndBracketedIpv6) {
  struct Case {
    const char* address;
    const char* host;
    int port;
  } cases[] = {{"127.0.0.1:50051", "127.0.0.1", 50051},
               {"localhost:0", "localhost", 0},
               {"expert-0.himoe:65535", "expert-0.himoe", 65535},
               {"[::1]:8080", "::1", 8080},
               {"[::]:1", "::", 1}};
  for (const Case& c : cases) {
    auto hp = ParseHostPort("--address", c.address);
    ASSERT_TRUE(hp.ok()) << c.address << ": " << hp.status();
    EXPECT_EQ(hp->host, c.host) << c.address;
    EXPECT_EQ(hp->port, c.port) << c.address;
    EXPECT_EQ(JoinHostPort(hp->host, hp->port), c.address);
  }
}

TEST(HostPortTest, RefusesWhatIsNotHostPortNamingTheField) {
  struct Case {
    const char* address;
    const char* message;
  } cases[] = {{"127.0.0.1", "is not host:port"},
               {":50051", "has no host"},
               {"host:65536", "no valid port (0-65535)"},
               {"host:-1", "no valid port"},
               {"host:http", "no valid port"},
               {"[::1:50051", "is not [host]:port"},
               {"::1:50051", "write an IPv6 host as [host]:port"}};
  for (const Case& c : cases) {
    auto hp = ParseHostPort("groups[2].address", c.address);
    ASSERT_FALSE(hp.ok()) << c.address;
    EXPECT_EQ(hp.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(hp.status().message()), HasSubstr("groups[2].address"));
    EXPECT_THAT(std::string(hp.status().message()), HasSubstr(c.message)) << c.address;
  }
}

TEST(HostPortTest, LocalHostsAndDialHosts) {
  for (const char* h : {"127.0.0.1", "127.3.2.1", "0.0.0.0", "::1", "::", "localhost"}) {
    EXPECT_TRUE(IsLocalHost(h)) << h;
  }
  for (const char* h : {"10.213.0.11", "192.168.1.1", "2001:db8::1", "expert-0"}) {
    EXPECT_FALSE(IsLocalHost(h)) << h;
  }
  EXPECT_EQ(DialHost("0.0.0.0"), "127.0.0.1");
  EXPECT_EQ(DialHost("::"), "::1");
  EXPECT_EQ(DialHost("10.0.0.2"), "10.0.0.2");
}

}  // namespace
}  // namespace himoe
