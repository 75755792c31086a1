#include "tests/http_get.h"

#include <curl/curl.h>

#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace himoe::testutil {
namespace {

size_t AppendToString(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& url) {
  static const CURLcode init = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (init != CURLE_OK) return absl::InternalError(curl_easy_strerror(init));
  std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> curl(curl_easy_init(),
                                                           curl_easy_cleanup);
  if (curl == nullptr) return absl::InternalError("curl_easy_init failed");
  std::string body;
  curl_easy_setopt(curl.get(), CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl.get(), CURLOPT_WRITEFUNCTION, AppendToString);
  curl_easy_setopt(curl.get(), CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(curl.get(), CURLOPT_NOSIGNAL, 1L);
  // Not an assertion on speed: it only keeps a hung server from hanging ctest.
  curl_easy_setopt(curl.get(), CURLOPT_TIMEOUT, 30L);
  const CURLcode rc = curl_easy_perform(curl.get());
  if (rc != CURLE_OK) {
    return absl::UnavailableError(
        absl::StrCat("GET ", url, ": ", curl_easy_strerror(rc)));
  }
  long http_code = 0;
  curl_easy_getinfo(curl.get(), CURLINFO_RESPONSE_CODE, &http_code);
  if (http_code != 200) {
    return absl::UnknownError(absl::StrCat("GET ", url, ": HTTP ", http_code));
  }
  return body;
}

absl::StatusOr<double> ScrapeValue(const std::string& exposition,
                                   const std::string& name,
                                   const std::string& labels) {
  const std::string key = labels.empty() ? name + " " : absl::StrCat(name, "{", labels, "} ");
  std::istringstream lines(exposition);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size()));
  }
  return absl::NotFoundError(absl::StrCat("no sample ", key));
}

}  // namespace himoe::testutil
