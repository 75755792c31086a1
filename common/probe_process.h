#ifndef HIMOE_COMMON_PROBE_PROCESS_H_
#define HIMOE_COMMON_PROBE_PROCESS_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace himoe {

// A probe runs in a process of its own, so that what it sets (BLIS reads its
// environment once, at its first call; OpenMP keeps its pool) and how it
// fails (SIGILL on kernels the CPU lacks, a hang) stay out of this one. It
// answers one line: "OK <value>" or "ERR <why>".

// Variables a probe's process sets before it runs; an empty value unsets.
using ProbeEnv = std::vector<std::pair<std::string, std::string>>;

// "OK <x>" -> x; otherwise 0, and the error text in `error`.
double ParseProbeAnswer(const std::string& answer, std::string* error);

// Forks; the child applies `env`, runs `body` and writes its answer to a
// pipe. A child that crashes or runs past `timeout_seconds` (then killed)
// yields "ERR ...". Fork before this process starts OpenMP threads: OpenMP
// hangs in a child forked after the parent used it.
std::string RunInChild(const ProbeEnv& env, const std::function<std::string()>& body,
                       double timeout_seconds = 30);

// Starts this program again (/proc/self/exe, no arguments) with `env` applied
// and `request_env` set to request(fd), fd being the pipe the new process
// answers on; returns the answer, "ERR no answer" when there is none, or
// "ERR <call> failed". The new process, whose OpenMP and BLIS start fresh,
// answers from a static initializer, before main (AnswerAndExit).
std::string RunInFreshProcess(const std::string& request_env,
                              const std::function<std::string(int fd)>& request,
                              const ProbeEnv& env);

// In a process RunInFreshProcess started: writes `answer` to `fd` and exits
// without running main.
[[noreturn]] void AnswerAndExit(int fd, const std::string& answer);

}  // namespace himoe

#endif  // HIMOE_COMMON_PROBE_PROCESS_H_
