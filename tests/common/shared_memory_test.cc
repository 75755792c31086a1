#include "common/shared_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(SharedMemoryTest, AnOpenedRegionSeesTheCreatorsBytesAndTheirsItsOwn) {
  auto owner = SharedMemoryRegion::Create("t", 4096);
  ASSERT_TRUE(owner.ok()) << owner.status();
  EXPECT_THAT((*owner)->name(), StartsWith(absl::StrCat("/himoe-", getpid(), "-")));
  EXPECT_EQ((*owner)->size(), 4096u);
  auto peer = SharedMemoryRegion::Open((*owner)->name());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*peer)->size(), 4096u);

  uint8_t* a = *(*owner)->Slice(128, 64, "a");
  uint8_t* b = *(*peer)->Slice(128, 64, "b");
  EXPECT_NE(a, b);  // two mappings of one object
  std::memset(a, 0x5a, 64);
  EXPECT_EQ(b[0], 0x5a);
  EXPECT_EQ(b[63], 0x5a);
  b[10] = 7;
  EXPECT_EQ(a[10], 7);
}

TEST(SharedMemoryTest, TheCreatorUnlinksTheNameAndAnOpenerKeepsItsMapping) {
  auto owner = SharedMemoryRegion::Create("t", 4096);
  ASSERT_TRUE(owner.ok()) << owner.status();
  const std::string name = (*owner)->name();
  auto peer = SharedMemoryRegion::Open(name);
  ASSERT_TRUE(peer.ok()) << peer.status();
  std::memset(*(*owner)->Slice(0, 64, "a"), 3, 64);
  owner->reset();
  auto again = SharedMemoryRegion::Open(name);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound) << again.status();
  EXPECT_EQ((*(*peer)->Slice(0, 64, "b"))[5], 3);
  // An opener going leaves nothing behind either (no name of its own).
  peer->reset();
  EXPECT_EQ(access(absl::StrCat("/dev/shm", name).c_str(), F_OK), -1);
}

// A region larger than /dev/shm is an error when it is made (its pages are
// taken then), not a SIGBUS at the first write, and leaves no name behind.
TEST(SharedMemoryTest, ARegionThatDoesNotFitIsRefusedWhenMade) {
  struct statvfs fs;
  ASSERT_EQ(statvfs("/dev/shm", &fs), 0);
  if (fs.f_blocks == 0) GTEST_SKIP() << "/dev/shm has no size limit here";
  const uint64_t too_big = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize + (uint64_t{1} << 30);
  const auto made = SharedMemoryRegion::Create("big", too_big);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kUnavailable) << made.status();
  EXPECT_THAT(made.status().message(), HasSubstr("allocating"));
  const std::string prefix = absl::StrCat("himoe-", getpid(), "-");
  const auto names = ListDirectory("/dev/shm");
  ASSERT_TRUE(names.ok()) << names.status();
  for (const std::string& name : *names) EXPECT_NE(name.rfind(prefix, 0), 0u) << name;
}

bool Exists(const std::string& name) {
  return access(absl::StrCat("/dev/shm", name).c_str(), F_OK) == 0;
}

// A region whose creator was SIGKILLed stays in /dev/shm (nothing unlinked
// it); the sweep removes it, and leaves alone the regions of creators alive,
// here and in another process.
TEST(SharedMemoryTest, TheSweepRemovesTheRegionsOfKilledCreatorsOnly) {
  auto mine = SharedMemoryRegion::Create("live", 4096);
  ASSERT_TRUE(mine.ok()) << mine.status();
  int to_parent[2];
  ASSERT_EQ(pipe(to_parent), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(to_parent[0]);
    auto region = SharedMemoryRegion::Create("killed", 3 << 20);
    const std::string name = region.ok() ? (*region)->name() : "";
    if (write(to_parent[1], name.c_str(), name.size() + 1) < 0) _exit(1);
    while (true) pause();  // until SIGKILL: no destructor runs
  }
  bool reaped = false;
  absl::Cleanup stop_child = [&] {
    if (reaped) return;
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  };
  close(to_parent[1]);
  char buffer[128] = {};
  for (size_t got = 0; got < sizeof(buffer) - 1;) {
    const ssize_t n = read(to_parent[0], buffer + got, sizeof(buffer) - 1 - got);
    if (n <= 0 || buffer[got + n - 1] == '\0') break;
    got += n;
  }
  close(to_parent[0]);
  const std::string theirs = buffer;

  ASSERT_THAT(theirs, StartsWith(absl::StrCat("/himoe-", child, "-")));
  RemoveOrphanedSharedMemory();  // both creators alive
  EXPECT_TRUE(Exists(theirs));
  EXPECT_TRUE(Exists((*mine)->name()));

  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  reaped = true;
  EXPECT_TRUE(Exists(theirs));  // left behind
  const OrphanedSharedMemory removed = RemoveOrphanedSharedMemory();
  EXPECT_FALSE(Exists(theirs));
  // (Another test process's pool may have swept it first.)
  if (removed.regions > 0) {
    EXPECT_GE(removed.bytes, uint64_t{3} << 20);
  }
  EXPECT_TRUE(Exists((*mine)->name()));
  // An opener's mapping does not make a region live: only the creator's lock.
  const std::string name = (*mine)->name();
  auto peer = SharedMemoryRegion::Open(name);
  ASSERT_TRUE(peer.ok()) << peer.status();
  mine->reset();
  EXPECT_FALSE(Exists(name));
}

// An object with a size and no lock is an orphan (its creator took the lock
// before sizing it); one without a size may be a creator's between shm_open
// and flock, so it stays.
TEST(SharedMemoryTest, TheSweepLeavesObjectsWithoutASize) {
  const std::string name = absl::StrCat("/himoe-", getpid(), "-sweep-test");
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  RemoveOrphanedSharedMemory();
  EXPECT_TRUE(Exists(name));
  ASSERT_EQ(ftruncate(fd, 8192), 0);
  close(fd);
  RemoveOrphanedSharedMemory();
  EXPECT_FALSE(Exists(name));
  shm_unlink(name.c_str());
}

TEST(SharedMemoryTest, SlicesOutsideTheRegionOrMisalignedAreRefusedNamingTheField) {
  auto region = SharedMemoryRegion::Create("t", 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_TRUE((*region)->Slice(4032, 64, "x").ok());
  EXPECT_TRUE((*region)->Slice(4096, 0, "x").ok());
  const absl::Status past = (*region)->Slice(4032, 65, "inputs[0].rows.shared").status();
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past.message(), HasSubstr("inputs[0].rows.shared: bytes [4032, 4032 + 65)"));
  EXPECT_THAT(past.message(), HasSubstr("of 4096 bytes"));
  // No wrap-around of offset + bytes.
  EXPECT_FALSE((*region)->Slice(64, ~uint64_t{0} - 8, "x").ok());
  EXPECT_FALSE((*region)->Slice(8192, 0, "x").ok());
  const absl::Status odd = (*region)->Slice(32, 8, "y").status();
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.message(), HasSubstr("y.offset: 32 is not a multiple of 64"));
}

TEST(SharedMemoryTest, OnlyHimoeNamesAreOpened) {
  for (const std::string& bad :
       std::vector<std::string>{"", "/", "/himoe-", "himoe-x", "/dev/shm/himoe-x", "/himoe-a/b",
                                "/himoe-../x", "/other-x", std::string("/himoe-") + "x\n",
                                "/himoe-" + std::string(60, 'a')}) {
    const absl::Status s = CheckSharedMemoryName(bad, "region");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()), StartsWith("region: '")) << bad;
    EXPECT_EQ(SharedMemoryRegion::Open(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_TRUE(CheckSharedMemoryName("/himoe-12-ab.c_d-e", "region").ok());
  EXPECT_EQ(SharedMemoryRegion::Open("/himoe-no-such-region").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(SharedMemoryRegion::Create("t", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedMemoryRegion::Create("bad/tag", 64).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SharedMemoryTest, AttachmentsOpenOnceKeepTheRecentOnesAndSayWhereTheClientIs) {
  SharedMemoryAttachments attachments(/*capacity=*/2);
  std::unique_ptr<SharedMemoryRegion> owned[3];
  for (auto& r : owned) {
    auto made = SharedMemoryRegion::Create("t", 4096);
    ASSERT_TRUE(made.ok()) << made.status();
    r = std::move(*made);
  }
  auto first = attachments.Find(owned[0]->name(), owned[0]->key(), "f");
  ASSERT_TRUE(first.ok()) << first.status();
  auto same = attachments.Find(owned[0]->name(), owned[0]->key(), "f");
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(first->get(), same->get());  // opened once
  ASSERT_TRUE(attachments.Find(owned[1]->name(), owned[1]->key(), "f").ok());
  ASSERT_TRUE(attachments.Find(owned[2]->name(), owned[2]->key(), "f").ok());
  EXPECT_EQ(attachments.open_regions(), 2u);
  // Closed by the cache, still mapped for the call that holds it.
  std::memset(*owned[0]->Slice(0, 64, "a"), 9, 64);
  EXPECT_EQ((*(*first)->Slice(0, 64, "b"))[0], 9);

  const auto missing = attachments.Find("/himoe-gone", "k", "inputs[1].rows.shared");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("inputs[1].rows.shared.region"));
  EXPECT_THAT(missing.status().message(), HasSubstr("a client on this host"));
  EXPECT_EQ(attachments.Find("/tmp/x", "k", "f").status().code(),
            absl::StatusCode::kInvalidArgument);

  const std::string own_name = owned[1]->name();
  const std::string own_key = owned[1]->key();
  OwnSharedMemory own(std::shared_ptr<SharedMemoryRegion>(std::move(owned[1])));
  auto found = own.Find(own_name, own_key, "x");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ((*found)->name(), own_name);
  const auto other = own.Find(owned[2]->name(), owned[2]->key(), "outputs[0].rows.shared");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other.status().message(), HasSubstr("is not the region this call sent"));
}

// The key is the creator's secret: random per region, kept in a header the
// data never overwrite, and required by every lookup a service makes.
TEST(SharedMemoryTest, ARegionIsTakenOnlyWithItsKey) {
  auto owner = SharedMemoryRegion::Create("t", 4096);
  auto other = SharedMemoryRegion::Create("t", 4096);
  ASSERT_TRUE(owner.ok()) << owner.status();
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string key = (*owner)->key();
  ASSERT_EQ(key.size(), kSharedMemoryKeyBytes);
  EXPECT_NE(key, std::string(kSharedMemoryKeyBytes, '\0'));
  EXPECT_NE(key, (*other)->key());
  std::memset(*(*owner)->Slice(0, 4096, "all"), 0xff, 4096);  // every data byte
  auto peer = SharedMemoryRegion::Open((*owner)->name());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*peer)->key(), key);
  EXPECT_EQ((*peer)->size(), 4096u);
  EXPECT_TRUE((*peer)->CheckKey(key, "f").ok());

  std::string wrong = key;
  wrong[kSharedMemoryKeyBytes - 1] ^= 1;
  for (const std::string& bad : {wrong, key.substr(0, 8), key + "x", (*other)->key()}) {
    const absl::Status s = (*peer)->CheckKey(bad, "inputs[0].rows.shared");
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(std::string(s.message()),
                StartsWith("inputs[0].rows.shared.key: not the key of region"));
  }
  const absl::Status missing = (*peer)->CheckKey("", "output_slice");
  EXPECT_EQ(missing.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(missing.message()), StartsWith("output_slice.key: missing"));

  // A service's lookups: refused before the region is opened for the caller,
  // and again once another caller has it open.
  SharedMemoryAttachments attachments(/*capacity=*/4);
  const auto refused = attachments.Find((*owner)->name(), wrong, "inputs[1].rows.shared");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_EQ(attachments.open_regions(), 0u);
  ASSERT_TRUE(attachments.Find((*owner)->name(), key, "f").ok());
  EXPECT_EQ(attachments.Find((*owner)->name(), (*other)->key(), "f").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(attachments.Find((*owner)->name(), "", "f").status().code(),
            absl::StatusCode::kPermissionDenied);
  // A client's check of its own region in an answer.
  const std::string other_name = (*other)->name();
  OwnSharedMemory own(std::shared_ptr<SharedMemoryRegion>(std::move(*other)));
  EXPECT_EQ(own.Find(other_name, key, "x").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(own.Find((*owner)->name(), key, "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// What another program (or a caller) put in /dev/shm under a himoe name is no
// region: it has no header, hence no key.
TEST(SharedMemoryTest, AnObjectWithoutTheHeaderIsRefused) {
  for (const off_t size : {off_t{16}, off_t{8192}}) {
    const std::string name = absl::StrCat("/himoe-", getpid(), "-no-header-", size);
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    absl::Cleanup unlink = [&] { shm_unlink(name.c_str()); };
    ASSERT_EQ(ftruncate(fd, size), 0);
    close(fd);
    const auto opened = SharedMemoryRegion::Open(name);
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
    EXPECT_THAT(opened.status().message(),
                HasSubstr(size < 64 ? "fewer than a himoe region's header" : "no himoe header"));
    SharedMemoryAttachments attachments(/*capacity=*/1);
    EXPECT_EQ(attachments.Find(name, std::string(kSharedMemoryKeyBytes, '\0'), "f").status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace himoe
