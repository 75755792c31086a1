#ifndef HIMOE_COMMON_THREAD_STACK_H_
#define HIMOE_COMMON_THREAD_STACK_H_

#include <cstddef>

namespace himoe {

// Bytes of thread-local storage declared by every object loaded in this
// process (their PT_TLS segments, each rounded up to its alignment). glibc
// places the static part of it at the top of every new thread's stack.
size_t LoadedTlsBytes();

// The stack size to ask glibc for so that a thread keeps `usable` bytes of
// stack after glibc has carved out the static TLS: `usable` plus
// LoadedTlsBytes() plus a page for the thread descriptor, page-rounded.
size_t StackSizeKeeping(size_t usable);

}  // namespace himoe

#endif  // HIMOE_COMMON_THREAD_STACK_H_
