#include "common/shared_memory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace himoe {
namespace {

constexpr absl::string_view kPrefix = "/himoe-";
constexpr size_t kMaxNameBytes = 64;

bool NameChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }

absl::Status Errno(absl::string_view what, const std::string& name) {
  const int e = errno;
  const std::string message = absl::StrCat(what, " '", name, "': ", std::strerror(e));
  return e == ENOENT ? absl::NotFoundError(message) : absl::UnavailableError(message);
}

absl::StatusOr<uint8_t*> MapWhole(int fd, uint64_t bytes, const std::string& name) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return Errno("mmap", name);
  return static_cast<uint8_t*>(base);
}

}  // namespace

absl::Status CheckSharedMemoryName(absl::string_view name, absl::string_view field) {
  bool ok = absl::StartsWith(name, kPrefix) && name.size() > kPrefix.size() &&
            name.size() <= kMaxNameBytes;
  for (size_t i = kPrefix.size(); ok && i < name.size(); ++i) ok = NameChar(name[i]);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": '", name, "' is not a himoe shared-memory name; expected '", kPrefix,
      "' then letters, digits, '.', '_' or '-', at most ", kMaxNameBytes, " bytes"));
}

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(
    absl::string_view tag, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("shared memory: a region needs bytes > 0");
  std::random_device random;
  const uint64_t nonce = (static_cast<uint64_t>(random()) << 32) ^ random();
  const std::string name = absl::StrCat(kPrefix, getpid(), "-", absl::Hex(nonce), "-", tag);
  if (absl::Status s = CheckSharedMemoryName(name, "shared memory tag"); !s.ok()) return s;
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return Errno("shm_open", name);
  const auto fail = [&](absl::Status s) {
    close(fd);
    shm_unlink(name.c_str());
    return s;
  };
  // A shared lock, held until the region goes and dropped by the kernel
  // however this process ends: RemoveOrphanedSharedMemory tells a live
  // creator's object by it. Taken before the object has a size.
  if (flock(fd, LOCK_SH) != 0) return fail(Errno("locking", name));
  // posix_fallocate, not only ftruncate: the pages are taken now, so a full
  // /dev/shm is an error here rather than a SIGBUS at the first write.
  const int err = ftruncate(fd, static_cast<off_t>(bytes)) != 0
                      ? errno
                      : posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    errno = err;
    return fail(Errno("allocating", name));
  }
  auto base = MapWhole(fd, bytes, name);
  if (!base.ok()) return fail(base.status());
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, *base, bytes, /*owner=*/true, fd));
}

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Open(
    const std::string& name) {
  if (absl::Status s = CheckSharedMemoryName(name, "shared memory region"); !s.ok()) return s;
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return Errno("shm_open", name);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const absl::Status s = Errno("fstat", name);
    close(fd);
    return s;
  }
  if (st.st_size <= 0) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory region '", name, "' is empty"));
  }
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  auto base = MapWhole(fd, bytes, name);
  close(fd);
  if (!base.ok()) return base.status();
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, *base, bytes, /*owner=*/false, -1));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(base_, size_);
  if (owner_) shm_unlink(name_.c_str());
  if (fd_ >= 0) close(fd_);  // drops the lock, after the name is gone
}

OrphanedSharedMemory RemoveOrphanedSharedMemory() {
  OrphanedSharedMemory removed;
  DIR* dir = opendir("/dev/shm");  // where glibc's shm_open keeps its objects
  if (dir == nullptr) return removed;
  while (const dirent* entry = readdir(dir)) {
    if (!absl::StartsWith(entry->d_name, kPrefix.substr(1))) continue;
    const std::string name = absl::StrCat("/", entry->d_name);
    if (!CheckSharedMemoryName(name, "").ok()) continue;
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (fd < 0) continue;
    struct stat st;
    // Unlocked with a size: its creator has ended (an object without a size
    // may be one whose creator is between shm_open and flock).
    if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &st) == 0 && st.st_size > 0 &&
        st.st_uid == geteuid() && shm_unlink(name.c_str()) == 0) {
      ++removed.regions;
      removed.bytes += static_cast<uint64_t>(st.st_size);
    }
    close(fd);
  }
  closedir(dir);
  return removed;
}

absl::StatusOr<uint8_t*> SharedMemoryRegion::Slice(uint64_t offset, uint64_t bytes,
                                                   absl::string_view field) const {
  if (offset % kSharedMemoryAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".offset: ", offset, " is not a multiple of ", kSharedMemoryAlignment));
  }
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": bytes [", offset, ", ", offset, " + ", bytes, ") lie outside region '", name_,
        "' of ", size_, " bytes"));
  }
  return base_ + offset;
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemoryAttachments::Find(
    const std::string& name, absl::string_view field) {
  if (absl::Status s = CheckSharedMemoryName(name, absl::StrCat(field, ".region")); !s.ok()) {
    return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if ((*it)->name() != name) continue;
    regions_.splice(regions_.begin(), regions_, it);
    return regions_.front();
  }
  auto opened = SharedMemoryRegion::Open(name);
  if (!opened.ok()) {
    return absl::Status(
        opened.status().code() == absl::StatusCode::kNotFound
            ? absl::StatusCode::kFailedPrecondition
            : opened.status().code(),
        absl::StrCat(field, ".region: ", opened.status().message(),
                     opened.status().code() == absl::StatusCode::kNotFound
                         ? " (shared memory works only with a client on this host)"
                         : ""));
  }
  regions_.push_front(std::move(*opened));
  // Calls still running keep a closed region's mapping alive (shared_ptr).
  while (regions_.size() > capacity_) regions_.pop_back();
  return regions_.front();
}

size_t SharedMemoryAttachments::open_regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.size();
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> OwnSharedMemory::Find(
    const std::string& name, absl::string_view field) {
  if (region_ != nullptr && region_->name() == name) return region_;
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".region: '", name, "' is not the region this call sent ('",
      region_ == nullptr ? "" : region_->name(), "')"));
}

}  // namespace himoe
