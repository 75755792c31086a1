#include "common/probe_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace himoe {
namespace {

void ApplyEnv(const ProbeEnv& env) {
  for (const auto& [name, value] : env) {
    if (value.empty()) {
      unsetenv(name.c_str());
    } else {
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

}  // namespace

double ParseProbeAnswer(const std::string& answer, std::string* error) {
  double value = 0;
  if (absl::StartsWith(answer, "OK ") &&
      absl::SimpleAtod(answer.substr(3), &value)) {
    return value;
  }
  *error = std::string(absl::StripPrefix(answer, "ERR "));
  return 0;
}

std::string RunInChild(const ProbeEnv& env, const std::function<std::string()>& body,
                       double timeout_seconds) {
  int fds[2];
  if (pipe(fds) != 0) return "ERR pipe failed";
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return "ERR fork failed";
  }
  if (pid == 0) {
    close(fds[0]);
    ApplyEnv(env);
    const std::string answer = body();
    ssize_t ignored = write(fds[1], answer.data(), answer.size());
    (void)ignored;
    _exit(0);
  }
  close(fds[1]);
  std::string answer;
  const auto start = std::chrono::steady_clock::now();
  char buffer[256];
  bool eof = false;
  while (!eof && Seconds(start) < timeout_seconds) {
    pollfd pfd{fds[0], POLLIN, 0};
    if (poll(&pfd, 1, 1000) <= 0) continue;
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n > 0) {
      answer.append(buffer, n);
    } else {
      eof = true;  // the child wrote its answer, or died
    }
  }
  close(fds[0]);
  if (!eof) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!eof) return "ERR timed out";
  if (WIFSIGNALED(status)) {
    return absl::StrCat("ERR killed by signal ", WTERMSIG(status));
  }
  return answer.empty() ? "ERR no answer" : answer;
}

std::string RunInFreshProcess(const std::string& request_env,
                              const std::function<std::string(int fd)>& request,
                              const ProbeEnv& env) {
  int fds[2];
  if (pipe(fds) != 0) return "ERR pipe failed";
  fcntl(fds[0], F_SETFD, FD_CLOEXEC);
  const std::string value = request(fds[1]);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return "ERR fork failed";
  }
  if (pid == 0) {
    setenv(request_env.c_str(), value.c_str(), 1);
    ApplyEnv(env);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    execv(self, argv);
    _exit(127);
  }
  close(fds[1]);
  std::string answer;
  char buffer[256];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) answer.append(buffer, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return answer.empty() ? "ERR no answer" : answer;
}

void AnswerAndExit(int fd, const std::string& answer) {
  ssize_t ignored = write(fd, answer.data(), answer.size());
  (void)ignored;
  _exit(0);
}

}  // namespace himoe
