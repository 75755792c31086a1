#ifndef HIMOE_COMMON_FILE_UTIL_H_
#define HIMOE_COMMON_FILE_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

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

// The paths below are POSIX calls, not std::filesystem: pip's LibTorch (2.5
// and later) exports its own std::filesystem, which then takes our calls and
// crashes (pytorch/pytorch#133437).

// What stat(2) finds at `path`, following symbolic links.
enum class PathKind { kMissing, kFile, kDirectory, kOther };
PathKind KindOf(const std::string& path);
inline bool IsDirectory(const std::string& path) { return KindOf(path) == PathKind::kDirectory; }
inline bool IsRegularFile(const std::string& path) { return KindOf(path) == PathKind::kFile; }

// "dir/name", one slash between them; `name` alone when `dir` is empty.
std::string JoinPath(absl::string_view dir, absl::string_view name);
// What follows the last '/' ("c" of "a/b/c"; "" of "a/").
std::string Basename(absl::string_view path);
// What precedes the last '/' ("a/b" of "a/b/c", "/" of "/a", "." of "a").
std::string Dirname(const std::string& path);

absl::StatusOr<int64_t> FileSize(const std::string& path);
// mkdir -p; an existing directory is fine.
absl::Status CreateDirectories(const std::string& path);
// rm -rf: symbolic links are removed, not followed; a missing path is fine.
absl::Status RemoveAll(const std::string& path);
absl::Status RenamePath(const std::string& from, const std::string& to);
// realpath(3).
absl::StatusOr<std::string> CanonicalPath(const std::string& path);
// The names in `dir` (not "." or ".."), in no particular order.
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir);
// The regular files (and symbolic links to them) under `dir`, recursively,
// in no particular order; like std::filesystem::recursive_directory_iterator
// with skip_permission_denied, it does not enter symbolic links to
// directories, nor directories it may not read below `dir`.
absl::StatusOr<std::vector<std::string>> RegularFilesUnder(const std::string& dir);

}  // namespace himoe

#endif  // HIMOE_COMMON_FILE_UTIL_H_
