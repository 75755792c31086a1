#include "common/cluster_config.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_cores.h"
#include "common/host_port.h"
#include "common/status_macros.h"

namespace himoe {
namespace {

class ErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    absl::StrAppend(&errors_, errors_.empty() ? "" : "; ", "line ", line + 1, ":",
                    column + 1, ": ", message);
  }
  const std::string& errors() const { return errors_; }

 private:
  std::string errors_;
};

absl::Status Invalid(absl::string_view origin, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": ", message));
}

// The text format takes nan and inf for a double; no routing setting means
// anything with them, and range checks such as "T > 0" let nan through.
absl::Status CheckRoutingFinite(const v1::RoutingSpec& routing, absl::string_view origin) {
  const google::protobuf::Reflection& reflection = *routing.GetReflection();
  const google::protobuf::Descriptor& descriptor = *routing.GetDescriptor();
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const google::protobuf::FieldDescriptor& field = *descriptor.field(i);
    if (field.cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE ||
        !reflection.HasField(routing, &field)) {
      continue;
    }
    const double value = reflection.GetDouble(routing, &field);
    if (!std::isfinite(value)) {
      return Invalid(origin, absl::StrCat("routing.", field.name(),
                                          " must be a finite number, got ", value));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ClusterConfig> ParseClusterConfig(absl::string_view text,
                                                     absl::string_view origin) {
  v1::ClusterConfig c;
  google::protobuf::TextFormat::Parser parser;
  ErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &c)) {
    return Invalid(origin, absl::StrCat("not a valid ClusterConfig text proto: ",
                                        errors.errors()));
  }
  v1::ModelSpec& m = *c.mutable_model();
  if (m.num_layers() == 0) m.set_num_layers(1);
  if (m.top_k() == 0) m.set_top_k(1);
  if (m.expert_dtype().empty()) m.set_expert_dtype("float32");
  if (m.matmul_dtype().empty()) m.set_matmul_dtype("float32");
  if (m.num_groups() == 0) m.set_num_groups(c.groups_size());
  if (c.routing().method().empty()) c.mutable_routing()->set_method("himoe");
  if (c.routing().preset().empty()) c.mutable_routing()->set_preset("paper");
  v1::RouterSpec& r = *c.mutable_router();
  if (r.wire_dtype().empty()) r.set_wire_dtype("float32");
  if (r.chunk_bytes() == 0) r.set_chunk_bytes(4 << 20);
  if (r.deadline_ms() == 0) r.set_deadline_ms(10000);
  if (r.max_batch_tokens() == 0) r.set_max_batch_tokens(8192);
  if (r.max_queue_delay_us() == 0) r.set_max_queue_delay_us(500);
  if (r.max_queue_requests() == 0) r.set_max_queue_requests(4096);
  if (r.max_batches_in_flight() == 0) r.set_max_batches_in_flight(2);
  if (r.max_tokens_per_request() == 0) r.set_max_tokens_per_request(65536);
  if (!r.has_keepalive_ms()) r.set_keepalive_ms(2000);

  if (m.num_layers() < 1) return Invalid(origin, "model.num_layers must be >= 1");
  if (m.d_model() < 1) return Invalid(origin, "model.d_model must be >= 1");
  if (m.d_ff() < 1) return Invalid(origin, "model.d_ff must be >= 1");
  if (m.num_experts() < 1) return Invalid(origin, "model.num_experts must be >= 1");
  if (c.groups_size() == 0) return Invalid(origin, "groups: at least one group is needed");
  if (m.num_groups() != c.groups_size()) {
    return Invalid(origin, absl::StrCat("model.num_groups is ", m.num_groups(), " but ",
                                        c.groups_size(), " groups are listed"));
  }
  if (m.num_experts() % m.num_groups() != 0) {
    return Invalid(origin, absl::StrCat("model.num_experts (", m.num_experts(),
                                        ") must be divisible by the number of groups (",
                                        m.num_groups(), ")"));
  }
  if (m.expert_dtype() != "float32" && m.expert_dtype() != "bfloat16") {
    return Invalid(origin, absl::StrCat("model.expert_dtype must be float32 or bfloat16, got '",
                                        m.expert_dtype(), "'"));
  }
  if (m.matmul_dtype() != "float32" && m.matmul_dtype() != "bfloat16") {
    return Invalid(origin, absl::StrCat("model.matmul_dtype must be float32 or bfloat16, got '",
                                        m.matmul_dtype(), "'"));
  }
  if (r.wire_dtype() != "float32" && r.wire_dtype() != "bfloat16") {
    return Invalid(origin, absl::StrCat("router.wire_dtype must be float32 or bfloat16, got '",
                                        r.wire_dtype(), "'"));
  }
  for (int g = 0; g < c.groups_size(); ++g) {
    const v1::GroupSpec& group = c.groups(g);
    if (group.address().empty() || group.address().find(':') == std::string::npos) {
      return Invalid(origin, absl::StrCat("groups[", g, "].address must be host:port, got '",
                                          group.address(), "'"));
    }
    if (group.threads() < 0) {
      return Invalid(origin, absl::StrCat("groups[", g, "].threads must be >= 0"));
    }
  }
  if (r.chunk_bytes() < 1 || r.deadline_ms() < 1 || r.max_batch_tokens() < 1 ||
      r.max_queue_delay_us() < 0 || r.max_tokens_per_request() < 1 ||
      r.max_queue_requests() < 1 || r.max_batches_in_flight() < 1) {
    return Invalid(origin, "router: chunk_bytes, deadline_ms, max_batch_tokens, "
                           "max_tokens_per_request, max_queue_requests and "
                           "max_batches_in_flight must be >= 1, max_queue_delay_us >= 0");
  }
  if (r.threads() < 0) return Invalid(origin, "router.threads must be >= 0");
  if (r.keepalive_ms() < 0) {
    return Invalid(
        origin, absl::StrCat("router.keepalive_ms must be >= 0 (0 = off), got ", r.keepalive_ms()));
  }
  if (r.shared_memory()) {
    for (int g = 0; g < c.groups_size(); ++g) {
      std::vector<std::pair<std::string, std::string>> addresses = {
          {absl::StrCat("groups[", g, "].address"), c.groups(g).address()}};
      for (int i = 0; i < c.groups(g).replicas_size(); ++i) {
        addresses.emplace_back(absl::StrCat("groups[", g, "].replicas[", i, "]"),
                               c.groups(g).replicas(i));
      }
      for (const auto& [field, address] : addresses) {
        absl::StatusOr<HostPort> hp = ParseHostPort(field, address);
        if (!hp.ok()) return Invalid(origin, hp.status().message());
        if (!IsLocalHost(hp->host)) {
          return Invalid(origin, absl::StrCat(
                                     "router.shared_memory needs every group on this host; ",
                                     field, " is ", address));
        }
      }
    }
  }
  HIMOE_RETURN_IF_ERROR(CheckRoutingFinite(c.routing(), origin));
  if (c.has_tls()) {
    const v1::TlsSpec& t = c.tls();
    if (t.ca().empty() || t.cert().empty() || t.key().empty()) {
      return Invalid(origin, "tls: ca, cert and key are all needed (PEM files)");
    }
    for (const auto& [name, role] :
         {std::pair{"trainer", &t.trainer()}, std::pair{"router", &t.router()}}) {
      const bool set = name == std::string("trainer") ? t.has_trainer() : t.has_router();
      if (set && (role->cert().empty() || role->key().empty() || role->identity().empty())) {
        return Invalid(origin,
                       absl::StrCat("tls.", name, ": cert, key and identity are all needed"));
      }
    }
    if (t.has_router() && !t.has_trainer()) {
      return Invalid(origin, "tls.router: roles need tls.trainer too (no one could train)");
    }
  }
  return c;
}

absl::StatusOr<v1::ClusterConfig> LoadClusterConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cluster file ", path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  absl::StatusOr<v1::ClusterConfig> c = ParseClusterConfig(buffer.str(), path);
  if (c.ok() && c->has_tls()) {
    const std::string::size_type slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
    v1::TlsSpec* t = c->mutable_tls();
    std::vector<std::string*> files = {t->mutable_ca(), t->mutable_cert(), t->mutable_key()};
    for (v1::TlsRole* role : {t->has_trainer() ? t->mutable_trainer() : nullptr,
                              t->has_router() ? t->mutable_router() : nullptr}) {
      if (role != nullptr) files.insert(files.end(), {role->mutable_cert(), role->mutable_key()});
    }
    for (std::string* file : files) {
      if (!file->empty() && (*file)[0] != '/') *file = dir + *file;
    }
  }
  return c;
}

int ServiceThreads(const v1::ClusterConfig& cluster, int configured) {
  return configured > 0 ? configured : ShareOfCores(cluster.groups_size() + 1);
}

int LocalServiceThreads(const v1::ClusterConfig& cluster) {
  int threads = 0;
  for (const v1::GroupSpec& g : cluster.groups()) {
    auto hp = ParseHostPort("cluster groups address", g.address());
    if (hp.ok() && IsLocalHost(hp->host)) threads += ServiceThreads(cluster, g.threads());
  }
  return threads > 0 ? threads + ServiceThreads(cluster, cluster.router().threads()) : 0;
}

std::string ExpertsOffThisHostCpu(const v1::ClusterConfig& cluster) {
  for (int i = 0; i < cluster.groups_size(); ++i) {
    const v1::GroupSpec& g = cluster.groups(i);
    auto hp = ParseHostPort("cluster groups address", g.address());
    if (!hp.ok() || !IsLocalHost(hp->host)) {
      return absl::StrCat("group ", i, " is on another host (", g.address(), ")");
    }
    if (!g.device().empty() && g.device() != "cpu") {
      return absl::StrCat("group ", i, " is on ", g.device());
    }
  }
  return "";
}

TlsFiles ClusterTls(const v1::ClusterConfig& cluster, const TlsFiles& flags, ClusterRole role) {
  if (flags.enabled() || !cluster.has_tls()) return flags;
  const v1::TlsSpec& t = cluster.tls();
  const bool has = role == ClusterRole::kTrainer  ? t.has_trainer()
                   : role == ClusterRole::kRouter ? t.has_router()
                                                  : false;
  if (!has) return TlsFiles{t.ca(), t.cert(), t.key()};
  const v1::TlsRole& r = role == ClusterRole::kTrainer ? t.trainer() : t.router();
  return TlsFiles{t.ca(), r.cert(), r.key()};
}

}  // namespace himoe
