#include "common/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace himoe {
namespace {

absl::Status ErrnoError(absl::string_view what) { return absl::ErrnoToStatus(errno, what); }

int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) {
  return ::remove(path);
}

// Appends the regular files under `dir` to `out`; `top` failures are errors,
// deeper directories that cannot be opened are skipped.
absl::Status CollectRegularFiles(const std::string& dir, bool top, std::vector<std::string>* out) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (!top && (errno == EACCES || errno == EPERM)) return absl::OkStatus();
    return ErrnoError(absl::StrCat("list ", dir));
  }
  absl::Status status;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    const std::string path = JoinPath(dir, name);
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) continue;  // gone meanwhile
    if (S_ISDIR(st.st_mode)) {
      status = CollectRegularFiles(path, false, out);
      if (!status.ok()) break;
    } else if (S_ISREG(st.st_mode) ||
               (S_ISLNK(st.st_mode) && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode))) {
      out->push_back(path);
    }
  }
  ::closedir(d);
  return status;
}

}  // namespace

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string Basename(absl::string_view path) {
  const size_t slash = path.rfind('/');
  return std::string(slash == absl::string_view::npos ? path : path.substr(slash + 1));
}

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

PathKind KindOf(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return PathKind::kMissing;
  if (S_ISREG(st.st_mode)) return PathKind::kFile;
  if (S_ISDIR(st.st_mode)) return PathKind::kDirectory;
  return PathKind::kOther;
}

absl::StatusOr<int64_t> FileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoError(absl::StrCat("stat ", path));
  return static_cast<int64_t>(st.st_size);
}

absl::Status CreateDirectories(const std::string& path) {
  for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string prefix = path.substr(0, end);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError(absl::StrCat("mkdir ", prefix));
    }
    if (end == std::string::npos) break;
  }
  if (!IsDirectory(path)) {
    return absl::FailedPreconditionError(absl::StrCat("mkdir ", path, ": not a directory"));
  }
  return absl::OkStatus();
}

absl::Status RemoveAll(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoError(absl::StrCat("remove ", path));
  }
  if (::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    return ErrnoError(absl::StrCat("remove ", path));
  }
  return absl::OkStatus();
}

absl::Status RenamePath(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoError(absl::StrCat("rename ", from, " -> ", to));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CanonicalPath(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return ErrnoError(absl::StrCat("realpath ", path));
  std::string out = resolved;
  std::free(resolved);
  return out;
}

absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoError(absl::StrCat("list ", dir));
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

absl::StatusOr<std::vector<std::string>> RegularFilesUnder(const std::string& dir) {
  std::vector<std::string> out;
  HIMOE_RETURN_IF_ERROR(CollectRegularFiles(dir, true, &out));
  return out;
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view data,
                                 bool durable) {
  const std::string tmp = absl::StrCat(path, ".tmp-", static_cast<int64_t>(::getpid()));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", tmp));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status s = ErrnoError(absl::StrCat("write ", tmp));
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (durable && ::fsync(fd) != 0) {
    const absl::Status s = ErrnoError(absl::StrCat("fsync ", tmp));
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::close(fd) != 0) {
    const absl::Status s = ErrnoError(absl::StrCat("close ", tmp));
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status s = ErrnoError(absl::StrCat("rename ", tmp, " -> ", path));
    ::unlink(tmp.c_str());
    return s;
  }
  return durable ? FsyncDir(Dirname(path)) : absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", path));
  std::string data;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status s = ErrnoError(absl::StrCat("read ", path));
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return data;
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(absl::StrCat("open ", dir));
  const int rc = ::fsync(fd);
  const int fsync_errno = errno;
  ::close(fd);
  if (rc != 0) {
    errno = fsync_errno;
    return ErrnoError(absl::StrCat("fsync ", dir));
  }
  return absl::OkStatus();
}

}  // namespace himoe
