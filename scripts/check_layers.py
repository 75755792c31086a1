#!/usr/bin/python3
"""Checks that the code keeps its layers (README "Architecture").

The CMake targets make the linker enforce most of the architecture; this
script checks what the linker cannot see, over the #include graph:

  * the core targets (compute and model code) never include gRPC or
    Prometheus, directly or through any project header they include;
  * himoe_local (and so himoe-cluster) never includes LibTorch or glog;
  * folders only include the folders below them (router_service/ never
    includes trainer/, expert_service/ never includes router_service/, ...);
    a file follows the rule of the deepest folder that has one, so the
    routing core (router_service/routing/) has its own: it includes neither
    model/, trainer/ nor the serving files of router_service/, while model/
    may include the routing core and no other part of router_service/;
  * no project file calls at::parallel_for or at::parallel_reduce: their
    OpenMP region is a header template that compiles only in a translation
    unit built with -fopenmp, which the project's are not (the torch
    precompiled header), so they ran on one thread; common/parallel_for.h's
    ParallelForRange is the one to call.

  scripts/check_layers.py [--root DIR]   exit 0 when clean, 1 with every violation
  scripts/check_layers.py --self-test    plants violations in a copy; each must fail
"""

import argparse
import os
import re
import shutil
import sys
import tempfile

CORE_TARGETS = [
    "himoe_util", "himoe_config", "himoe_common", "himoe_experts", "himoe_routing",
    "himoe_expert_core", "himoe_model",
]
NO_TORCH_TARGETS = ["himoe_util", "himoe_config", "himoe_local"]

TRANSPORT = re.compile(r'^(grpcpp/|grpc/|grpc\+\+/|prometheus/)|\.grpc\.pb\.h$')
TORCH = re.compile(r'^(torch/|ATen/|c10/|glog/)')

# folder -> (project paths its files must not include, exceptions to those).
# A file follows the rule of the deepest folder listed here that holds it.
FOLDER_RULES = {
    "common": (["expert_service", "router_service", "model", "trainer", "deploy"], []),
    "expert_service": (["router_service", "model", "trainer", "deploy"], []),
    "router_service/routing": (["router_service", "model", "trainer", "deploy"],
                               ["router_service/routing"]),
    "router_service": (["trainer", "deploy"], []),
    "model": (["router_service", "trainer", "deploy", "expert_service/expert_client.h"],
              ["router_service/routing"]),
    "trainer": (["router_service", "deploy/local/launcher_main.cc"], ["router_service/routing"]),
    "deploy/local": (["expert_service", "router_service", "model", "trainer"], []),
}

SERIAL_ATEN_LOOP = re.compile(r'\bat::parallel_(for|reduce)\s*\(')
SOURCE_FOLDERS = ["common", "expert_service", "router_service", "model", "trainer", "deploy",
                  "tests"]
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
ADD_LIBRARY = re.compile(r'add_library\(\s*(\w+)\s+STATIC\s+([^)]*)\)', re.S)


def targets(root):
    """target -> source files (relative to root), from every CMakeLists.txt."""
    out = {}
    for folder in ["common", "expert_service", "router_service", "router_service/routing",
                   "model", "trainer", "deploy/local", "proto"]:
        path = os.path.join(root, folder, "CMakeLists.txt")
        if not os.path.exists(path):
            continue
        text = re.sub(r'#[^\n]*', '', open(path).read())
        for name, body in ADD_LIBRARY.findall(text):
            files = [os.path.join(folder, f) for f in body.split()
                     if f.endswith((".cc", ".h"))]
            out[name] = files
    return out


_CACHE = {}


def includes(root, rel):
    key = (root, rel)
    if key not in _CACHE:
        try:
            _CACHE[key] = INCLUDE.findall(open(os.path.join(root, rel)).read())
        except OSError:
            _CACHE[key] = []
    return _CACHE[key]


def is_project(root, inc):
    return os.path.exists(os.path.join(root, inc))


def closure(root, rel):
    """Every (file, include, chain) reachable from rel through project headers."""
    seen, stack = {rel: [rel]}, [rel]
    while stack:
        f = stack.pop()
        for inc in includes(root, f):
            yield f, inc, seen[f]
            if is_project(root, inc) and inc not in seen:
                seen[inc] = seen[f] + [inc]
                stack.append(inc)


def with_headers(root, files):
    out = []
    for f in files:
        out.append(f)
        h = os.path.splitext(f)[0] + ".h"
        if f.endswith(".cc") and os.path.exists(os.path.join(root, h)):
            out.append(h)
    return out


def under(path, prefixes):
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def rule_folder(rel):
    """The deepest folder of FOLDER_RULES that holds rel."""
    return max((f for f in FOLDER_RULES if rel.startswith(f + "/")), key=len)


def source_files(root):
    """Every .cc and .h under the folders of FOLDER_RULES, relative to root."""
    out = set()
    for folder in FOLDER_RULES:
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for name in names:
                if name.endswith((".cc", ".h")):
                    out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def check(root):
    _CACHE.clear()
    errors = []
    libs = targets(root)
    for target in CORE_TARGETS + NO_TORCH_TARGETS:
        if target not in libs:
            errors.append(f"target {target} is missing from the CMakeLists")
    for target, pattern, what in (
            [(t, TRANSPORT, "gRPC/Prometheus") for t in CORE_TARGETS] +
            [(t, TORCH, "LibTorch/glog") for t in NO_TORCH_TARGETS]):
        for src in with_headers(root, libs.get(target, [])):
            for f, inc, chain in closure(root, src):
                if pattern.search(inc):
                    errors.append(f"{target}: {' -> '.join(chain)} includes <{inc}>"
                                  f" ({what} in a layer that must not use it)")
    for rel in sorted(source_files(root)):
        folder = rule_folder(rel)
        banned, allowed = FOLDER_RULES[folder]
        for inc in includes(root, rel):
            if not is_project(root, inc) or under(inc, allowed):
                continue
            bad = [b for b in banned if under(inc, [b])]
            if bad:
                errors.append(f"{rel} includes {inc}: {folder}/ must not depend on {bad[0]}")
    for folder in SOURCE_FOLDERS:
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for name in sorted(names):
                if not name.endswith((".cc", ".h")):
                    continue
                path = os.path.join(dirpath, name)
                text = open(path).read()
                for m in SERIAL_ATEN_LOOP.finditer(text):
                    line = text.count("\n", 0, m.start()) + 1
                    errors.append(f"{os.path.relpath(path, root)}:{line} calls {m.group(0)[:-1]}"
                                  " (one thread here: use ParallelForRange, common/parallel_for.h)")
    return sorted(set(errors))


def self_test(root):
    plants = [
        ("router_service/routing/routing_math.h", "#include <grpcpp/grpcpp.h>", "himoe_routing"),
        ("router_service/routing/router_layer.h", '#include "trainer/trainer.h"', "router_layer.h"),
        ("common/named_tensor.h", "#include <prometheus/counter.h>", "himoe_"),
        ("deploy/local/local_cluster.h", "#include <torch/torch.h>", "himoe_local"),
        ("model/transformer_lm.h", '#include "router_service/remote_moe.h"', "model/"),
        ("model/attention.cc", "void F() { at::parallel_for(0, 1, 1, [](int64_t, int64_t) {}); }",
         "calls at::parallel_for"),
        # The routing core's own rule, beneath router_service/'s.
        ("router_service/routing/router_layer.cc", '#include "model/transformer_lm.h"',
         "router_service/routing/ must not depend on model"),
        ("router_service/routing/routing_strategy.h", '#include "router_service/batcher.h"',
         "router_service/routing/ must not depend on router_service"),
        ("router_service/routing/local_moe.cc", '#include "trainer/trainer.h"',
         "router_service/routing/ must not depend on trainer"),
        # model/ and trainer/ reach router_service/ only through the routing core.
        ("model/moe_layers.h", '#include "router_service/batched_moe.h"',
         "model/ must not depend on router_service"),
        ("trainer/backend_moe.cc", '#include "router_service/remote_moe.h"',
         "trainer/ must not depend on router_service"),
    ]
    # Includes the rules allow: each must leave the check as clean as before.
    allowed = [
        ("model/transformer_lm.cc", '#include "router_service/routing/dispatch_combine.h"'),
        ("trainer/backend_moe.cc", '#include "router_service/routing/routing_math.h"'),
        ("router_service/batcher.cc", '#include "model/transformer_lm.h"'),
        ("router_service/batcher.cc", '#include "router_service/routing/routing_stats.h"'),
    ]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for folder in ["common", "expert_service", "router_service", "model", "trainer",
                       "deploy", "proto", "tests"]:
            shutil.copytree(os.path.join(root, folder), os.path.join(tmp, folder))
        clean = check(tmp)
        if clean:
            print("self-test: the unmodified copy fails:\n  " + "\n  ".join(clean))
            ok = False
        for rel, line, expect in plants:
            path = os.path.join(tmp, rel)
            original = open(path).read()
            open(path, "w").write(line + "\n" + original)
            found = check(tmp)
            hit = [e for e in found if expect in e]
            print(f"self-test: planted {line!r} in {rel}: "
                  f"{'caught' if hit else 'MISSED'}" + (f": {hit[0]}" if hit else ""))
            ok = ok and bool(hit)
            open(path, "w").write(original)
        for rel, line in allowed:
            path = os.path.join(tmp, rel)
            original = open(path).read()
            open(path, "w").write(line + "\n" + original)
            new = sorted(set(check(tmp)) - set(clean))
            print(f"self-test: allowed {line!r} in {rel}: "
                  f"{'clean' if not new else 'FLAGGED: ' + new[0]}")
            ok = ok and not new
            open(path, "w").write(original)
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return 0 if self_test(args.root) else 1
    errors = check(args.root)
    for e in errors:
        print("layer violation:", e)
    if not errors:
        print("layers: clean")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
