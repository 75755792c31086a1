#!/usr/bin/env bash
# The binaries call no std::filesystem function of a shared library. pip's
# LibTorch (2.5 and later) exports a std::filesystem of its own; linked before
# libstdc++, it takes such calls and they crash (pytorch/pytorch#133437).
# common/file_util's POSIX calls instead.
#   no_std_filesystem_test.sh BINARY...
set -uo pipefail
failures=0
for binary in "$@"; do
  calls="$(nm -D --undefined-only "${binary}" | c++filt | grep -F 'std::filesystem')"
  if [[ -n "${calls}" ]]; then
    echo "FAIL: $(basename "${binary}") calls std::filesystem:"
    echo "${calls}" | head -5
    failures=$((failures + 1))
  else
    echo "ok: $(basename "${binary}")"
  fi
done
exit $((failures > 0))
