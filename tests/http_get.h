#ifndef HIMOE_TESTS_HTTP_GET_H_
#define HIMOE_TESTS_HTTP_GET_H_

#include <string>

#include "absl/status/statusor.h"

namespace himoe::testutil {

// Returns the body of a 200 response to GET `url` (libcurl).
absl::StatusOr<std::string> HttpGet(const std::string& url);

// The value of the sample `name{labels}` (labels as exposed, e.g.
// 'layer="0"'; empty for none) in Prometheus text exposition, or NotFound.
absl::StatusOr<double> ScrapeValue(const std::string& exposition,
                                   const std::string& name,
                                   const std::string& labels);

}  // namespace himoe::testutil

#endif  // HIMOE_TESTS_HTTP_GET_H_
