#include "common/shared_memory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace himoe {
namespace {

constexpr absl::string_view kPrefix = "/himoe-";
constexpr size_t kMaxNameBytes = 64;
constexpr absl::string_view kHeaderMagic = "himoerg1";
static_assert(kHeaderMagic.size() + kSharedMemoryKeyBytes <= kSharedMemoryHeaderBytes);

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
  if (bytes > std::numeric_limits<uint64_t>::max() / 2) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory: ", bytes, " bytes is too many"));
  }
  std::random_device random;  // /dev/urandom
  const uint64_t nonce = (static_cast<uint64_t>(random()) << 32) ^ random();
  std::string key(kSharedMemoryKeyBytes, '\0');
  for (size_t i = 0; i < key.size(); i += 4) {
    const uint32_t word = random();
    std::memcpy(&key[i], &word, 4);
  }
  const uint64_t file_bytes = kSharedMemoryHeaderBytes + bytes;
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
  const int err = ftruncate(fd, static_cast<off_t>(file_bytes)) != 0
                      ? errno
                      : posix_fallocate(fd, 0, static_cast<off_t>(file_bytes));
  if (err != 0) {
    errno = err;
    return fail(Errno("allocating", name));
  }
  auto map = MapWhole(fd, file_bytes, name);
  if (!map.ok()) return fail(map.status());
  std::memcpy(*map, kHeaderMagic.data(), kHeaderMagic.size());
  std::memcpy(*map + kHeaderMagic.size(), key.data(), key.size());
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, std::move(key), *map, bytes, /*owner=*/true, fd));
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
  if (st.st_size < static_cast<off_t>(kSharedMemoryHeaderBytes)) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory region '", name, "' has ", st.st_size,
                     " bytes, fewer than a himoe region's header"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  auto map = MapWhole(fd, file_bytes, name);
  close(fd);
  if (!map.ok()) return map.status();
  if (std::memcmp(*map, kHeaderMagic.data(), kHeaderMagic.size()) != 0) {
    munmap(*map, file_bytes);
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory region '", name, "' has no himoe header"));
  }
  std::string key(reinterpret_cast<const char*>(*map) + kHeaderMagic.size(), kSharedMemoryKeyBytes);
  return std::unique_ptr<SharedMemoryRegion>(new SharedMemoryRegion(
      name, std::move(key), *map, file_bytes - kSharedMemoryHeaderBytes, /*owner=*/false, -1));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(map_, kSharedMemoryHeaderBytes + size_);
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
  return map_ + kSharedMemoryHeaderBytes + offset;
}

absl::Status SharedMemoryRegion::CheckKey(absl::string_view key, absl::string_view field) const {
  if (key.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        field, ".key: missing; region '", name_, "' is used only with the key its creator sent"));
  }
  unsigned char diff = key.size() == key_.size() ? 0 : 1;
  for (size_t i = 0; i < key_.size(); ++i) {
    diff |= static_cast<unsigned char>(key_[i] ^ (i < key.size() ? key[i] : 0));
  }
  if (diff == 0) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(field, ".key: not the key of region '", name_,
                   "'; a service reads and writes a region only for the client that created it"));
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> SharedMemoryAttachments::Find(
    const std::string& name, absl::string_view key, absl::string_view field) {
  if (absl::Status s = CheckSharedMemoryName(name, absl::StrCat(field, ".region")); !s.ok()) {
    return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if ((*it)->name() != name) continue;
    HIMOE_RETURN_IF_ERROR((*it)->CheckKey(key, field));
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
  HIMOE_RETURN_IF_ERROR((*opened)->CheckKey(key, field));
  regions_.push_front(std::move(*opened));
  // Calls still running keep a closed region's mapping alive (shared_ptr).
  while (regions_.size() > capacity_) regions_.pop_back();
  return regions_.front();
}

size_t SharedMemoryAttachments::open_regions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.size();
}

absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> OwnSharedMemory::Find(const std::string& name,
                                                                          absl::string_view key,
                                                                          absl::string_view field) {
  if (region_ != nullptr && region_->name() == name) {
    HIMOE_RETURN_IF_ERROR(region_->CheckKey(key, field));
    return region_;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".region: '", name, "' is not the region this call sent ('",
      region_ == nullptr ? "" : region_->name(), "')"));
}

}  // namespace himoe
