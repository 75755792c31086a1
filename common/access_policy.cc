#include "common/access_policy.h"

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace himoe {
namespace {

using Json = nlohmann::json;

// "*" matches anything; "x*" anything starting with "x"; else equality.
bool Glob(absl::string_view pattern, absl::string_view value) {
  if (pattern == "*") return true;
  if (absl::EndsWith(pattern, "*")) {
    return absl::StartsWith(value, pattern.substr(0, pattern.size() - 1));
  }
  return pattern == value;
}

class Reader {
 public:
  Reader(absl::string_view source, absl::Span<const std::string> methods)
      : source_(source), methods_(methods) {}

  absl::Status Error(absl::string_view field, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("authorization policy ", source_, ": ", field,
                                                   field.empty() ? "" : ": ", what));
  }

  // Only keys of `allowed`.
  absl::Status Keys(const Json& object, absl::string_view field,
                    std::initializer_list<absl::string_view> allowed) const {
    if (!object.is_object()) return Error(field, "expected an object");
    for (const auto& [key, value] : object.items()) {
      bool known = false;
      for (absl::string_view a : allowed) known = known || key == a;
      if (!known) {
        return Error(absl::StrCat(field, field.empty() ? "" : ".", key),
                     absl::StrCat("unknown key; expected one of ", absl::StrJoin(allowed, ", ")));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> String(const Json& value, absl::string_view field) const {
    if (!value.is_string() || value.get<std::string>().empty()) {
      return Error(field, "expected a non-empty string");
    }
    return value.get<std::string>();
  }

  absl::StatusOr<std::vector<std::string>> Strings(const Json& value,
                                                   absl::string_view field) const {
    if (!value.is_array() || value.empty()) {
      return Error(field, "expected a non-empty array of strings");
    }
    std::vector<std::string> out;
    for (size_t i = 0; i < value.size(); ++i) {
      HIMOE_ASSIGN_OR_RETURN(std::string s, String(value[i], absl::StrCat(field, "[", i, "]")));
      out.push_back(std::move(s));
    }
    return out;
  }

  // rule[key][list] into *out, when rule has `key` (then *any = false):
  // {"source": {"principals": [...]}}, {"request": {"paths": [...]}}.
  absl::Status List(const Json& rule, absl::string_view field, const char* key, const char* list,
                    bool* any, std::vector<std::string>* out) const {
    if (!rule.contains(key)) return absl::OkStatus();
    const std::string f = absl::StrCat(field, ".", key);
    HIMOE_RETURN_IF_ERROR(Keys(rule[key], f, {list}));
    if (!rule[key].contains(list)) return Error(absl::StrCat(f, ".", list), "missing");
    *any = false;
    HIMOE_ASSIGN_OR_RETURN(*out, Strings(rule[key][list], absl::StrCat(f, ".", list)));
    return absl::OkStatus();
  }

  absl::Status CheckPath(const std::string& path, absl::string_view field) const {
    for (const std::string& m : methods_) {
      if (Glob(path, m)) return absl::OkStatus();
    }
    return Error(field,
                 absl::StrCat("'", path,
                              "' names no method of this service; expected "
                              "one of ",
                              absl::StrJoin(methods_, ", "), " (or a prefix ending in '*')"));
  }

 private:
  absl::string_view source_;
  absl::Span<const std::string> methods_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const AccessPolicy>> AccessPolicy::Parse(
    absl::string_view json, absl::string_view source, absl::Span<const std::string> methods) {
  const Reader reader(source, methods);
  const Json root = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return reader.Error("", "not JSON");
  HIMOE_RETURN_IF_ERROR(reader.Keys(root, "", {"name", "deny_rules", "allow_rules"}));
  auto policy = std::make_shared<AccessPolicy>();
  if (!root.contains("name")) return reader.Error("name", "missing");
  HIMOE_ASSIGN_OR_RETURN(policy->name_, reader.String(root["name"], "name"));
  if (!root.contains("allow_rules")) return reader.Error("allow_rules", "missing");
  for (const char* list : {"deny_rules", "allow_rules"}) {
    if (!root.contains(list)) continue;
    const Json& rules = root[list];
    if (!rules.is_array() || rules.empty()) {
      return reader.Error(list, "expected a non-empty array of rules");
    }
    std::vector<Rule>& out =
        absl::string_view(list) == "deny_rules" ? policy->deny_ : policy->allow_;
    for (size_t i = 0; i < rules.size(); ++i) {
      const std::string field = absl::StrCat(list, "[", i, "]");
      const Json& r = rules[i];
      HIMOE_RETURN_IF_ERROR(reader.Keys(r, field, {"name", "source", "request"}));
      Rule rule;
      if (!r.contains("name")) return reader.Error(absl::StrCat(field, ".name"), "missing");
      HIMOE_ASSIGN_OR_RETURN(rule.name, reader.String(r["name"], absl::StrCat(field, ".name")));
      HIMOE_RETURN_IF_ERROR(
          reader.List(r, field, "source", "principals", &rule.any_source, &rule.principals));
      HIMOE_RETURN_IF_ERROR(reader.List(r, field, "request", "paths", &rule.any_path, &rule.paths));
      for (size_t p = 0; p < rule.paths.size(); ++p) {
        HIMOE_RETURN_IF_ERROR(
            reader.CheckPath(rule.paths[p], absl::StrCat(field, ".request.paths[", p, "]")));
      }
      out.push_back(std::move(rule));
    }
  }
  return std::shared_ptr<const AccessPolicy>(std::move(policy));
}

absl::StatusOr<std::shared_ptr<const AccessPolicy>> AccessPolicy::FromFile(
    const std::string& path, absl::Span<const std::string> methods) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("authorization policy ", path, ": ", text.status().message()));
  }
  return Parse(*text, path, methods);
}

bool AccessPolicy::Matches(const Rule& rule, absl::string_view path, const Caller& caller) {
  bool path_ok = rule.any_path;
  for (const std::string& p : rule.paths) path_ok = path_ok || Glob(p, path);
  if (!path_ok) return false;
  if (rule.any_source) return true;
  if (!caller.authenticated) return false;
  for (const std::string& want : rule.principals) {
    for (const std::string& have : caller.principals) {
      if (Glob(want, have)) return true;
    }
  }
  return false;
}

absl::Status AccessPolicy::Check(absl::string_view path, const Caller& caller) const {
  const Rule* denied = nullptr;
  for (const Rule& r : deny_) {
    if (denied == nullptr && Matches(r, path, caller)) denied = &r;
  }
  bool allowed = false;
  for (const Rule& r : allow_) allowed = allowed || Matches(r, path, caller);
  if (denied == nullptr && allowed) return absl::OkStatus();
  const std::string who =
      !caller.authenticated ? "an unauthenticated caller (no client certificate)"
                            : absl::StrCat("caller [", absl::StrJoin(caller.principals, ", "), "]");
  return absl::PermissionDeniedError(absl::StrCat(
      path, ": ", who, " may not call it under authorization policy '", name_, "' (",
      denied != nullptr ? absl::StrCat("deny rule '", denied->name, "'") : "no allow rule matches",
      ")"));
}

}  // namespace himoe
