#include "common/thread_stack.h"

#include <link.h>
#include <unistd.h>

#include <cstdint>

namespace himoe {

size_t LoadedTlsBytes() {
  size_t total = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_TLS) continue;
          const size_t align = ph.p_align > 0 ? ph.p_align : 1;
          *static_cast<size_t*>(data) += (ph.p_memsz + align - 1) / align * align;
        }
        return 0;
      },
      &total);
  return total;
}

size_t StackSizeKeeping(size_t usable) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (usable > SIZE_MAX / 2) return usable;  // glibc refuses it anyway
  const size_t size = usable + LoadedTlsBytes() + page;
  return (size + page - 1) / page * page;
}

}  // namespace himoe
