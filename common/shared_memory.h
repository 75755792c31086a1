#ifndef HIMOE_COMMON_SHARED_MEMORY_H_
#define HIMOE_COMMON_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace himoe {

// Offsets in a region are multiples of this (any dtype's alignment, and a
// cache line).
inline constexpr uint64_t kSharedMemoryAlignment = 64;

inline uint64_t AlignSharedOffset(uint64_t offset) {
  return (offset + kSharedMemoryAlignment - 1) / kSharedMemoryAlignment *
         kSharedMemoryAlignment;
}

// "/himoe-" then 1-57 letters, digits, '.', '_' or '-'; InvalidArgument
// naming `field` otherwise.
absl::Status CheckSharedMemoryName(absl::string_view name, absl::string_view field);

// Bytes before a region's data: a magic, then the region's key.
inline constexpr uint64_t kSharedMemoryHeaderBytes = 64;
inline constexpr size_t kSharedMemoryKeyBytes = 16;

// A POSIX shared-memory object (shm_open), mapped read-write. The process
// that creates one holds a shared flock on it and unlinks its name when the
// region goes; a process that opens one only unmaps it.
//
// The object starts with a header holding a random key, which its creator
// sends with every slice it names. A service that opens regions for its
// callers uses one only with its key: a caller can name another caller's
// region, but cannot read or write it through the service.
class SharedMemoryRegion {
 public:
  // A new object of `bytes` data bytes (and the header), named
  // "/himoe-<pid>-<random>-<tag>" (tag: letters, digits, '.', '_' or '-').
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(absl::string_view tag,
                                                                    uint64_t bytes);
  // The existing object `name`, whole. NotFound when this host has none of
  // that name (the client runs elsewhere); FailedPrecondition when it has no
  // himoe header.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Open(const std::string& name);

  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;
  ~SharedMemoryRegion();

  const std::string& name() const { return name_; }
  // Data bytes (the header not counted).
  uint64_t size() const { return size_; }
  // kSharedMemoryKeyBytes bytes.
  const std::string& key() const { return key_; }
  // OK when `key` is this region's (compared in constant time);
  // PermissionDenied naming `field` otherwise.
  absl::Status CheckKey(absl::string_view key, absl::string_view field) const;
  // Data bytes [offset, offset + bytes): InvalidArgument naming `field`
  // unless offset is a multiple of kSharedMemoryAlignment and the range lies
  // inside.
  absl::StatusOr<uint8_t*> Slice(uint64_t offset, uint64_t bytes, absl::string_view field) const;

 private:
  SharedMemoryRegion(std::string name, std::string key, uint8_t* map, uint64_t size, bool owner,
                     int fd)
      : name_(std::move(name)),
        key_(std::move(key)),
        map_(map),
        size_(size),
        owner_(owner),
        fd_(fd) {}

  std::string name_;
  std::string key_;
  uint8_t* map_;  // the header; the data follow it
  uint64_t size_;
  bool owner_;
  int fd_;  // the creator's, holding the lock; -1 in an opener
};

// What RemoveOrphanedSharedMemory removed.
struct OrphanedSharedMemory {
  int regions = 0;
  uint64_t bytes = 0;
};

// Unlinks this user's himoe objects in /dev/shm whose creator has ended
// without unlinking them (SIGKILL, a crash): those no process holds the
// creator's lock on. The kernel drops that lock however a process ends, so
// this never takes a live creator's object, whatever PID namespace it is in.
// Processes that still map an orphan keep its pages until they unmap it.
OrphanedSharedMemory RemoveOrphanedSharedMemory();

// Finds the region a message names.
class SharedMemoryLookup {
 public:
  virtual ~SharedMemoryLookup() = default;
  // The region `name`, if `key` is its key. Errors name `field`.
  virtual absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> Find(const std::string& name,
                                                                   absl::string_view key,
                                                                   absl::string_view field) = 0;
};

// A service's regions: opened on first use and kept open (at most
// `capacity`; the least recently used is closed first, once no call holds it).
class SharedMemoryAttachments final : public SharedMemoryLookup {
 public:
  explicit SharedMemoryAttachments(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> Find(const std::string& name,
                                                           absl::string_view key,
                                                           absl::string_view field) override;
  size_t open_regions() const;

 private:
  size_t capacity_;
  mutable std::mutex mu_;
  std::list<std::shared_ptr<SharedMemoryRegion>> regions_;  // most recent first
};

// One region the caller created, and nothing else.
class OwnSharedMemory final : public SharedMemoryLookup {
 public:
  explicit OwnSharedMemory(std::shared_ptr<SharedMemoryRegion> region)
      : region_(std::move(region)) {}
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> Find(const std::string& name,
                                                           absl::string_view key,
                                                           absl::string_view field) override;

 private:
  std::shared_ptr<SharedMemoryRegion> region_;
};

}  // namespace himoe

#endif  // HIMOE_COMMON_SHARED_MEMORY_H_
