#!/usr/bin/python3
"""Checks that the project speaks of itself only.

README.md, docs/ and every source file (code, comments, scripts, build and
deploy files) say what the system is, how to use it, how it is built and what
it measures. Words about how the work on it was organised do not belong there:
periods of work, ticket numbers, work that was "blocked", "last week", and the
like. A dated measurement names its date, machine and commit instead.

  scripts/check_words.py [--root DIR]   exit 0 when clean, 1 naming every hit
  scripts/check_words.py --self-test    plants a word in a copy of the tree
                                        (README, docs/, a comment, a script);
                                        each plant must be caught
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Each rule: (name, pattern). Case-insensitive.
RULES = [
    ("a period of work", r"\bsess" r"ions?\b"),
    ("a ticket number", r"\b(issues?|tickets?|tasks?|bugs?|pr|pull requests?)\s*(no\.?\s*)?#?\s*\d+\b"),
    ("a ticket number", r"(?<![\w$&/{#])#\d{1,4}\b"),
    ("work status", r"\breported\s+blocked\b|\b(work|issue|ticket|task|target)s?\s+(is\s+|was\s+|are\s+|were\s+)?blocked\b"),
    ("a work period", r"\b(this|last|next|previous|earlier)\s+(week|sprint|wave|iteration|work\s+period)\b"),
    ("a work period", r"\bwork\s+periods?\b|\bwave\s+(one|two|three|four|\d+)\b|\bsprints?\b"),
    ("who tried what", r"\bwe\s+tried\b|\b(earlier|previous|first|second|third|last)\s+attempts?\b"),
    ("the developers' guide", r"\bdevelopers'?\s+guide\b|\bDEVELOPERS\.md\b"),
]
# Technical uses of a listed word (a TLS session, a session ticket).
ALLOWED = re.compile(r"\b(tls|ssl)[ -]sessions?\b|\bsession\s+(tickets?|resumption|cache|keys?)\b",
                     re.I)
COMPILED = [(name, re.compile(p, re.I)) for name, p in RULES]

TEXT_SUFFIXES = (
    ".md", ".cc", ".h", ".hpp", ".cpp", ".py", ".sh", ".txt", ".cmake", ".proto", ".yml", ".yaml",
    ".json", ".gp", ".textproto", ".supp", ".toml", ".cfg", ".in")
TEXT_NAMES = {"Dockerfile", "CMakeLists.txt", "run", "himoe-plot", ".gitignore", ".dockerignore"}
# Inputs, not prose: the fuzzers' seed corpora.
SKIP_DIRS = {".git", "corpus", "node_modules"}
THIS = os.path.join("scripts", "check_words.py")


def project_files(root):
    """Files the project holds: git's view when root is a checkout, else a walk."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard"],
            check=True, capture_output=True, text=True).stdout.split("\n")
        files = [f for f in out if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, names in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and
                           not os.path.exists(os.path.join(dirpath, d, "CMakeCache.txt"))]
            files += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    keep = []
    for f in sorted(files):
        parts = f.split("/")
        if any(p in SKIP_DIRS for p in parts[:-1]) or f == THIS:
            continue
        if parts[-1] in TEXT_NAMES or parts[-1].endswith(TEXT_SUFFIXES):
            keep.append(f)
    return keep


def check(root):
    hits = []
    for rel in project_files(root):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                lines = f.read().split("\n")
        except (OSError, UnicodeDecodeError):
            continue
        for number, line in enumerate(lines, 1):
            cleaned = ALLOWED.sub("", line)
            for name, pattern in COMPILED:
                m = pattern.search(cleaned)
                if m:
                    hits.append(f"{rel}:{number}: {name} ({m.group(0)!r}): {line.strip()[:120]}")
                    break
    return hits


def self_test(root):
    plants = [
        ("README.md", "Measured in the fourth " + "sess" + "ion on the VM."),
        ("docs/benchmarks.md", "This target stays reported blocked."),
        ("common/status_macros.h", "// Fixed for " + "iss" + "ue #11."),
        ("scripts/setup.sh", "# see #52 for the history"),
        ("trainer/trainer.cc", "// The last attempt at this was slower."),
        ("deploy/k8s/README.md", "Done in wave two, this week."),
    ]
    allowed = ("common/status_macros.h", "// A TLS session is resumed with a session ticket.")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "tree")
        for rel in project_files(root):
            dst = os.path.join(copy, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(os.path.join(root, rel), dst)
        if check(copy):
            print("self-test: the unmodified copy fails:\n  " + "\n  ".join(check(copy)[:10]))
            return False
        for rel, line in plants + [allowed]:
            path = os.path.join(copy, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            original = open(path).read() if os.path.exists(path) else None
            with open(path, "w") as f:
                f.write((original or "") + "\n" + line + "\n")
            found = [h for h in check(copy) if h.startswith(rel + ":")]
            expect_hit = (rel, line) != allowed
            good = bool(found) == expect_hit
            print(f"self-test: planted {line!r} in {rel}: "
                  f"{('caught: ' + found[0]) if found else 'not flagged'}"
                  f"{'' if good else '  <-- WRONG'}")
            ok = ok and good
            if original is None:
                os.remove(path)
            else:
                with open(path, "w") as f:
                    f.write(original)
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return 0 if self_test(args.root) else 1
    hits = check(args.root)
    for h in hits:
        print("words:", h)
    print(f"words: {len(hits)} lines speak of how the work was organised" if hits
          else "words: clean")
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main())
