#ifndef HIMOE_COMMON_FILE_UTIL_H_
#define HIMOE_COMMON_FILE_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace himoe {

// Writes `data` to "<path>.tmp-<pid>" and renames it over `path`, so readers
// see the old file or the new one, never a partial one. With `durable`, the
// data is fsynced before the rename and the directory after it.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view data,
                                 bool durable = false);

// The whole file; NotFound when it does not exist.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// fsync of a directory (after renames inside it).
absl::Status FsyncDir(const std::string& dir);

}  // namespace himoe

#endif  // HIMOE_COMMON_FILE_UTIL_H_
