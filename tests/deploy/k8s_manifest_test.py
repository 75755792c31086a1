#!/usr/bin/python3
"""Offline checks of the Kubernetes manifests (deploy/k8s) and the Dockerfile.

Renders deploy/k8s/base, overlays/gpu and overlays/data-parallel with `kubectl kustomize`
(every --kubectl given, default: the kubectl on PATH; scripts/setup.sh installs
one) and checks the rendered objects:

- the objects are there: StatefulSet + headless Service for the expert groups,
  Deployment + Service for the router, the trainer Job, the cluster ConfigMap,
  the checkpoint PVC, all in one namespace;
- every container's command runs (with stub himoe-* binaries, the env and the
  `$(VAR)` expansion of the kubelet) and the flags it ends with are the ones
  checked: an expert pod's --group_id is its ordinal, a trainer resumes only
  from a complete checkpoint and waits for every group of the cluster file;
- the gRPC, metrics ports of the flags = containerPorts = Service targetPorts =
  the gRPC liveness/readiness probes = the Prometheus scrape annotations;
- selectors select exactly their own pods; the headless Service is the
  StatefulSet's serviceName;
- the cluster file parses (himoe.v1.ClusterConfig, from proto/) and agrees with
  the StatefulSet (replicas = groups, addresses = pod DNS names and port, the
  model flags) and the trainer; the generated ConfigMap name is referenced;
- CPU requests everywhere; the GPU overlay gives experts nvidia.com/gpu: 1 and
  --device=cuda:0, the base --device=cpu and no GPU;
- the PVC is mounted in the trainer at its --out_dir; an expert's
  --run_state_file lies on a writable emptyDir of its pod;
- overlays/data-parallel: an Indexed Job of WORLD_SIZE trainer pods, RANK from
  the completion index, MASTER_ADDR the pod of index 0 through a headless
  Service that serves MASTER_PORT, a ReadWriteMany PVC, and each rank's
  wrapper execs himoe-trainer with that environment;
- deploy/docker/Dockerfile: multi-stage on debian:bookworm, runs
  scripts/setup.sh, ships the binaries the manifests run and (with
  --build-dir) the packages of every library they link.

Exit status 0 when everything holds; 1 with one line per failed check.

  /usr/bin/python3 tests/deploy/k8s_manifest_test.py [--kubectl PATH]...
      [--build-dir BUILD]
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:
    sys.exit("k8s_manifest_test: python3-yaml is missing (scripts/setup.sh installs it); "
             "run with /usr/bin/python3")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
K8S = os.path.join(REPO, "deploy", "k8s")
DOCKERFILE = os.path.join(REPO, "deploy", "docker", "Dockerfile")
VARIANTS = {"base": os.path.join(K8S, "base"), "gpu": os.path.join(K8S, "overlays", "gpu"),
            "data-parallel": os.path.join(K8S, "overlays", "data-parallel")}
# The annotation an Indexed Job's pod carries its completion index in.
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"

EXPERT, ROUTER, TRAINER = "himoe-expert", "himoe-router", "himoe-trainer"
BINARIES = {EXPERT: "expert_service", ROUTER: "router_service", TRAINER: "trainer"}
# Packages every debian:bookworm-slim image already has.
BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}
# Fields that must be lists wherever they occur (kustomize v2.0.3's commonLabels
# once turned a StatefulSet's missing volumeClaimTemplates into a map).
LIST_FIELDS = {"containers", "initContainers", "volumes", "volumeMounts", "env", "ports",
               "args", "command", "volumeClaimTemplates", "tolerations", "accessModes"}


class Checks:
    def __init__(self):
        self.failures = []
        self.passed = 0
        self.where = ""

    def check(self, ok, message):
        if ok:
            self.passed += 1
        else:
            self.failures.append(f"[{self.where}] {message}" if self.where else message)
        return ok


C = Checks()


# ---------------------------------------------------------------- rendering

def kubectl_version(kubectl):
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"],
                         capture_output=True, text=True)
    try:
        info = json.loads(out.stdout)
        v = info["clientVersion"]["gitVersion"]
        k = info.get("kustomizeVersion")
        return f"kubectl {v}" + (f", kustomize {k}" if k else "")
    except (ValueError, KeyError):
        return f"kubectl {kubectl}"


def render(kubectl, directory):
    out = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True)
    warnings = [l for l in out.stderr.strip().splitlines() if "Warning:" in l]
    if out.returncode != 0:
        errors = [l for l in out.stderr.strip().splitlines() if l not in warnings]
        C.check(False, f"`{kubectl} kustomize {os.path.relpath(directory, REPO)}` failed "
                       f"(exit {out.returncode}): {' '.join(errors)}")
        return None
    for line in out.stderr.strip().splitlines():  # e.g. deprecation warnings of kustomize v5
        print(f"  note: kustomize: {line}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# ------------------------------------------------------------ small helpers

def find(objs, kind, name=None, prefix=False):
    return [o for o in objs if o.get("kind") == kind and
            (name is None or o["metadata"]["name"] == name or
             (prefix and o["metadata"]["name"].startswith(name + "-")))]


def one(objs, kind, name, prefix=False):
    found = find(objs, kind, name, prefix)
    C.check(len(found) == 1, f"expected one {kind} {name}, found {len(found)}")
    return found[0] if len(found) == 1 else None


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def pod_labels(workload):
    return workload["spec"]["template"]["metadata"].get("labels") or {}


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def walk_list_fields(node, path, kind_name):
    if isinstance(node, dict):
        for k, v in node.items():
            if k in LIST_FIELDS and not isinstance(v, list):
                C.check(False, f"{kind_name}: {path}.{k} must be a list, is "
                               f"{type(v).__name__}: {v!r}")
            walk_list_fields(v, f"{path}.{k}", kind_name)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            walk_list_fields(v, f"{path}[{i}]", kind_name)


def cpu_cores(quantity):
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def expand(text, env):
    """The kubelet's $(VAR) expansion of command, args and env values."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":  # $$ -> $
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close >= 0:
                    name = text[i + 2:close]
                    out.append(env[name] if name in env else text[i:close + 1])
                    i = close + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def container_env(container, pod_name, annotations=None):
    env = {}
    for e in container.get("env") or []:
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        annotation = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", field or "")
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif field == "metadata.name":
            env[e["name"]] = pod_name
        elif annotation and annotation.group(1) in (annotations or {}):
            env[e["name"]] = annotations[annotation.group(1)]
        else:
            C.check(False, f"container {container['name']}: env {e['name']}: only values, "
                           f"the metadata.name fieldRef and the pod's annotations "
                           f"{sorted(annotations or {})} are understood by this test")
    return env


def parse_flags(argv):
    """absl flags of an argv (--name=value, --name value, --bool)."""
    flags, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a[2:].split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                k, v = a[2:], argv[i + 1]
                i += 1
            else:
                k, v = a[2:], "true"
            flags[k] = v
        i += 1
    return flags


def port_of(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


STUB = """#!/bin/sh
{ printf '%s\\n' "$(basename "$0")"; for a in "$@"; do printf '%s\\n' "$a"; done; } > "$STUB_OUT"
env > "$STUB_OUT.env"
"""


def run_container(container, pod_name, stubs, extra_env=None, arg_map=None, timeout=60,
                  annotations=None):
    """Runs the container's command + args as the kubelet would, with the
    himoe-* binaries replaced by stubs; returns (binary, argv) it exec'd (and
    leaves the environment it had in <stubs>/argv.txt.env)."""
    env = container_env(container, pod_name, annotations)
    argv = [expand(a, env) for a in (container.get("command") or []) +
            (container.get("args") or [])]
    for a in argv:
        for ref in re.findall(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", a):
            C.check(False, f"{pod_name}/{container['name']}: {ref} is not defined in the "
                           f"container's env (the kubelet leaves it as is)")
    if not argv:
        C.check(False, f"{pod_name}/{container['name']}: no command (the image's CMD would run)")
        return None, []
    if arg_map:
        argv = [arg_map.get(a, a) for a in argv]
    out_file = os.path.join(stubs, "argv.txt")
    if os.path.exists(out_file):
        os.remove(out_file)
    run_env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOSTNAME": pod_name, "STUB_OUT": out_file}
    run_env.update(env)
    run_env.update(extra_env or {})
    exe = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=run_env["PATH"])
    r = subprocess.run([exe] + argv[1:], env=run_env, capture_output=True, text=True,
                       timeout=timeout)
    if not C.check(r.returncode == 0 and os.path.exists(out_file),
                   f"{pod_name}/{container['name']}: the command did not exec a himoe-* binary "
                   f"(exit {r.returncode}): {r.stderr.strip()[-500:]}"):
        return None, []
    lines = open(out_file).read().split("\n")[:-1]
    return lines[0], lines[1:]


# ----------------------------------------------------------- cluster file

_CLUSTER_PB2 = None


def cluster_pb2():
    global _CLUSTER_PB2
    if _CLUSTER_PB2 is None:
        out = tempfile.mkdtemp(prefix="k8s-manifest-test-pb-")
        # protoc of protobuf-compiler (cluster.proto is proto2: any protoc compiles it).
        protoc = shutil.which("protoc")
        if protoc is None:
            sys.exit("k8s_manifest_test: protoc is missing (protobuf-compiler; "
                     "scripts/setup.sh installs it)")
        r = subprocess.run([protoc, f"-I{os.path.join(REPO, 'proto')}", f"--python_out={out}",
                            os.path.join(REPO, "proto", "himoe", "v1", "cluster.proto")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit("k8s_manifest_test: cannot compile proto/himoe/v1/cluster.proto with "
                     f"{protoc}: {r.stderr.strip()}")
        sys.path.insert(0, out)
        from himoe.v1 import cluster_pb2 as pb2  # noqa: E402
        _CLUSTER_PB2 = pb2
    return _CLUSTER_PB2


def parse_cluster(text):
    from google.protobuf import text_format
    pb2 = cluster_pb2()
    try:
        c = text_format.Parse(text, pb2.ClusterConfig())
    except text_format.ParseError as e:
        C.check(False, f"cluster file: not a valid himoe.v1.ClusterConfig: {e}")
        return None
    # The defaults of common/cluster_config.cc.
    if c.model.num_groups == 0:
        c.model.num_groups = len(c.groups)
    if c.model.num_layers == 0:
        c.model.num_layers = 1
    if not c.model.expert_dtype:
        c.model.expert_dtype = "float32"
    return c


# ------------------------------------------------------------ the checks

def check_variant(objs, variant, stubs):
    for o in objs:
        walk_list_fields(o, "", f"{o.get('kind')} {o.get('metadata', {}).get('name')}")

    sts = one(objs, "StatefulSet", EXPERT)
    dep = one(objs, "Deployment", ROUTER)
    job = one(objs, "Job", TRAINER)
    cm = one(objs, "ConfigMap", "himoe-cluster", prefix=True)
    pvcs = find(objs, "PersistentVolumeClaim")
    C.check(len(pvcs) == 1, f"expected one PersistentVolumeClaim, found {len(pvcs)}")
    if None in (sts, dep, job, cm) or len(pvcs) != 1:
        return
    pvc = pvcs[0]
    workloads = {EXPERT: sts, ROUTER: dep, TRAINER: job}

    # One namespace for everything, and it exists.
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    C.check(len(namespaces) == 1 and None not in namespaces,
            f"namespaced objects should share one namespace, have {sorted(map(str, namespaces))}")
    ns = next(iter(namespaces))
    C.check(any(o["kind"] == "Namespace" and o["metadata"]["name"] == ns for o in objs),
            f"no Namespace object {ns}")

    # The cluster file.
    C.check(re.fullmatch(r"himoe-cluster(-[a-z0-9]{10})?", cm["metadata"]["name"]) is not None,
            f"ConfigMap name {cm['metadata']['name']}")
    text = (cm.get("data") or {}).get("cluster.textproto")
    if not C.check(text is not None, "ConfigMap has no cluster.textproto"):
        return
    cluster = parse_cluster(text)
    if cluster is None:
        return

    # Run every container; collect its final flags.
    runs = {}  # component -> (container, binary, flags)
    for comp, w in workloads.items():
        containers = pod_spec(w)["containers"]
        C.check(len(containers) == 1, f"{comp}: expected one container, has {len(containers)}")
        c = containers[0]
        if comp == EXPERT:
            replicas = sts["spec"].get("replicas", 1)
            group_ids = []
            for g in range(replicas):
                binary, argv = run_container(c, f"{EXPERT}-{g}", stubs)
                flags = parse_flags(argv)
                group_ids.append(flags.get("group_id"))
                if g == 0:
                    runs[comp] = (c, binary, flags)
            C.check(group_ids == [str(g) for g in range(replicas)],
                    f"{EXPERT}: pods 0..{replicas - 1} run --group_id {group_ids}; "
                    "each must serve the group of its ordinal")
        elif comp == TRAINER:
            runs[comp] = (c,) + check_trainer_command(c, text, stubs)
        else:
            binary, argv = run_container(c, f"{ROUTER}-7d9f8b6c4-x2x2x", stubs)
            runs[comp] = (c, binary, parse_flags(argv))
        if runs.get(comp) and runs[comp][1] is not None:
            C.check(runs[comp][1] == comp,
                    f"{comp}: the container runs {runs[comp][1]}, expected {comp}")
    if any(runs.get(k) is None or runs[k][1] is None for k in workloads):
        return

    # Ports from the flags.
    ports = {}  # component -> {"grpc": n, "metrics": n}
    f = runs[EXPERT][2]
    # --address is host:port on every binary (himoe-expert has no --port).
    C.check("port" not in f, f"{EXPERT}: --port={f.get('port')}: himoe-expert has no --port "
                             "flag; give the port in --address=HOST:PORT")
    address = f.get("address") or "0.0.0.0:50051"
    if not C.check(re.fullmatch(r"(\[[^\]]*\]|[^:]*):\d+", address) is not None,
                   f"{EXPERT}: --address={address} is not HOST:PORT"):
        return
    host, p = port_of(address)
    C.check(host in ("0.0.0.0", "::"),
            f"{EXPERT}: --address={f.get('address')}: the kubelet's probes and other pods "
            "need it on all interfaces")
    ports[EXPERT] = {"grpc": p}
    f = runs[ROUTER][2]
    host, p = port_of(f.get("address") or cluster.router.address or "0.0.0.0:50050")
    C.check(host in ("0.0.0.0", "::", ""), f"{ROUTER}: listens on {host}, not all interfaces")
    ports[ROUTER] = {"grpc": p}
    C.check(not cluster.router.address or port_of(cluster.router.address)[1] == p,
            f"{ROUTER}: cluster file router.address {cluster.router.address} but the router "
            f"listens on port {p}")
    # Data-parallel ranks: rank 0 serves the rendezvous on MASTER_PORT.
    master_port = container_env(runs[TRAINER][0], TRAINER, {COMPLETION_INDEX: "0"}).get(
        "MASTER_PORT")
    if master_port is not None:
        ports.setdefault(TRAINER, {})["rendezvous"] = int(master_port)
    for comp in workloads:
        f = runs[comp][2]
        mp = f.get("metrics_port")
        if comp == ROUTER and mp is None:
            mp = cluster.router.metrics_port
        if mp is not None and int(mp) > 0:
            ports.setdefault(comp, {})["metrics"] = int(mp)
        C.check(f.get("metrics_address", "0.0.0.0") in ("0.0.0.0", "::"),
                f"{comp}: --metrics_address={f.get('metrics_address')} hides /metrics")
        C.check("metrics" in ports.get(comp, {}),
                f"{comp}: no fixed --metrics_port > 0 (Prometheus needs a known port)")
    if cluster.router.metrics_port:
        C.check(cluster.router.metrics_port == ports[ROUTER].get("metrics"),
                f"{ROUTER}: cluster file router.metrics_port {cluster.router.metrics_port}, "
                f"the router serves /metrics on {ports[ROUTER].get('metrics')}")

    for comp, w in workloads.items():
        c = runs[comp][0]
        want = ports.get(comp, {})
        cports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        C.check(cports == want, f"{comp}: containerPorts {cports} != the ports of its flags "
                                f"{want}")
        # Probes: gRPC health (grpc.health.v1) on the gRPC port.
        if "grpc" in want:
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                pr = c.get(probe)
                if pr is None and probe == "startupProbe":
                    continue
                if not C.check(pr is not None, f"{comp}: no {probe}"):
                    continue
                C.check(set(pr) & {"httpGet", "tcpSocket", "exec"} == set() and "grpc" in pr,
                        f"{comp}: {probe} should be a gRPC probe, is {sorted(pr)}")
                C.check((pr.get("grpc") or {}).get("port") == want["grpc"],
                        f"{comp}: {probe} probes port {(pr.get('grpc') or {}).get('port')}, "
                        f"the gRPC server listens on {want['grpc']}")
                C.check(not (pr.get("grpc") or {}).get("service"),
                        f"{comp}: {probe} names a service; the servers report the overall "
                        "status (service \"\")")
            if comp == ROUTER:
                # Serving while the Service drops the endpoint (preStop), then
                # up to 5 s of draining (RouterServer::Shutdown), within the grace.
                pre = ((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}
                cmd = pre.get("command") or []
                grace = pod_spec(w).get("terminationGracePeriodSeconds", 30)
                if C.check(len(cmd) == 2 and cmd[0] == "sleep" and cmd[1].isdigit(),
                           f"{comp}: preStop runs {cmd}; expected [\"sleep\", N]"):
                    C.check(1 <= int(cmd[1]) and int(cmd[1]) + 5 < grace,
                            f"{comp}: preStop sleeps {cmd[1]} s, then 5 s of draining, "
                            f"with a grace period of {grace} s")
        else:  # the trainer: no gRPC server, judged by its exit status
            C.check(w["kind"] == "Job", f"{comp}: a server without a gRPC port")
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                C.check("grpc" not in (c.get(probe) or {}),
                        f"{comp}: {probe} is a gRPC probe, but {comp} serves no gRPC")
        # Prometheus scrape annotations on the pods.
        ann = w["spec"]["template"]["metadata"].get("annotations") or {}
        if "metrics" in want:
            C.check(ann.get("prometheus.io/scrape") == "true",
                    f"{comp}: pod annotation prometheus.io/scrape is {ann.get('prometheus.io/scrape')!r}")
            C.check(ann.get("prometheus.io/port") == str(want["metrics"]),
                    f"{comp}: prometheus.io/port is {ann.get('prometheus.io/port')!r}, metrics "
                    f"are on {want['metrics']}")
            C.check(ann.get("prometheus.io/path", "/metrics") == "/metrics",
                    f"{comp}: prometheus.io/path is {ann.get('prometheus.io/path')!r}")
        # Resources: CPU requests; --threads within them; GPUs only for GPU experts.
        res = c.get("resources") or {}
        cpu = (res.get("requests") or {}).get("cpu")
        if C.check(cpu is not None, f"{comp}: no CPU request"):
            threads = int(runs[comp][2].get("threads", "0"))
            C.check(1 <= threads <= max(1, int(cpu_cores(cpu) + 0.999)),
                    f"{comp}: --threads={threads} with a CPU request of {cpu} (0 = every core "
                    "of the node; more than requested oversubscribes)")
        gpus = (res.get("limits") or {}).get("nvidia.com/gpu")
        device = runs[comp][2].get("device")
        if comp == EXPERT and variant == "gpu":
            C.check(str(gpus) == "1", f"{comp}: limits nvidia.com/gpu is {gpus!r}, want 1")
            C.check(device == "cuda:0", f"{comp}: --device={device}, want cuda:0")
        else:
            C.check(gpus is None, f"{comp}: nvidia.com/gpu {gpus!r} in the {variant} variant")
            if comp == EXPERT:
                C.check(device == "cpu", f"{comp}: --device={device}, want cpu")

    # Selectors: each controller and Service selects exactly its own pods.
    for comp, w in workloads.items():
        sel = (w["spec"].get("selector") or {}).get("matchLabels")
        if w["kind"] == "Job" and sel is None:
            continue  # generated by the API server from the pod's uid
        C.check(matches(sel, pod_labels(w)),
                f"{comp}: selector {sel} does not match its pod labels {pod_labels(w)}")
        others = [k for k, o in workloads.items() if k != comp and matches(sel, pod_labels(o))]
        C.check(not others, f"{comp}: selector {sel} also selects the pods of {others}")
    services = find(objs, "Service")
    for svc in services:
        name = svc["metadata"]["name"]
        sel = svc["spec"].get("selector")
        selected = [k for k, o in workloads.items() if matches(sel, pod_labels(o))]
        if not C.check(len(selected) == 1, f"Service {name}: selector {sel} selects the pods "
                                           f"of {selected}, expected exactly one workload"):
            continue
        comp = selected[0]
        c = runs[comp][0]
        by_name = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        for sp in svc["spec"].get("ports") or []:
            tp = sp.get("targetPort", sp["port"])
            resolved = by_name.get(tp) if isinstance(tp, str) else tp
            C.check(resolved in by_name.values(),
                    f"Service {name}: port {sp.get('name')} targetPort {tp!r} is no port of "
                    f"{comp} ({by_name})")
            if sp.get("name") in by_name:
                C.check(resolved == by_name[sp["name"]],
                        f"Service {name}: port {sp['name']} targets {resolved}, {comp} serves "
                        f"{sp['name']} on {by_name[sp['name']]}")
    # The Services that select a workload's pods (and no other workload's).
    svc_for = {k: [] for k in workloads}
    for svc in services:
        selected = [k for k, o in workloads.items()
                    if matches(svc["spec"].get("selector"), pod_labels(o))]
        if len(selected) == 1:
            svc_for[selected[0]].append(svc)
    C.check(any(s["spec"].get("clusterIP") != "None" for s in svc_for[ROUTER]),
            f"{ROUTER}: no (non-headless) Service selects it")
    headless = [s for s in services if s["metadata"]["name"] == sts["spec"].get("serviceName")]
    if C.check(len(headless) == 1, f"{EXPERT}: serviceName {sts['spec'].get('serviceName')!r} "
                                   "is no Service"):
        h = headless[0]
        C.check(h["spec"].get("clusterIP") == "None",
                f"Service {h['metadata']['name']} (serviceName of {EXPERT}) must be headless "
                f"(clusterIP: None), is {h['spec'].get('clusterIP')!r}")
        C.check(h in svc_for[EXPERT], f"Service {h['metadata']['name']} does not select the "
                                      f"{EXPERT} pods")

    # The cluster file against the StatefulSet.
    replicas = sts["spec"].get("replicas", 1)
    m = cluster.model
    C.check(len(cluster.groups) == m.num_groups == replicas,
            f"cluster file: {len(cluster.groups)} groups, model.num_groups {m.num_groups}; "
            f"StatefulSet {EXPERT} has {replicas} replicas: all three must be equal")
    C.check(m.num_groups > 0 and m.num_experts % m.num_groups == 0,
            f"cluster file: num_experts {m.num_experts} is no multiple of num_groups "
            f"{m.num_groups}")
    svc_name = sts["spec"].get("serviceName")
    for g, group in enumerate(cluster.groups):
        host, p = port_of(group.address)
        pod = f"{sts['metadata']['name']}-{g}.{svc_name}"
        ok_hosts = {pod, f"{pod}.{ns}", f"{pod}.{ns}.svc", f"{pod}.{ns}.svc.cluster.local"}
        C.check(host in ok_hosts, f"cluster file: groups[{g}].address {group.address}: the "
                                  f"host should be pod {g}'s DNS name {pod}[.{ns}.svc.cluster.local]")
        C.check(p == ports[EXPERT]["grpc"], f"cluster file: groups[{g}].address port {p}, the "
                                            f"expert pods listen on {ports[EXPERT]['grpc']}")
        if group.metrics_port:
            C.check(group.metrics_port == ports[EXPERT].get("metrics"),
                    f"cluster file: groups[{g}].metrics_port {group.metrics_port}, the expert "
                    f"pods serve /metrics on {ports[EXPERT].get('metrics')}")
        if group.device:
            C.check(group.device == runs[EXPERT][2].get("device"),
                    f"cluster file: groups[{g}].device {group.device}, the expert pods run "
                    f"--device={runs[EXPERT][2].get('device')}")
    f = runs[EXPERT][2]
    for flag, value in [("num_groups", m.num_groups), ("num_experts", m.num_experts),
                        ("num_layers", m.num_layers), ("d_model", m.d_model), ("d_ff", m.d_ff),
                        ("seed", m.seed), ("dtype", m.expert_dtype)]:
        C.check(f.get(flag) == str(value),
                f"{EXPERT}: --{flag}={f.get(flag)} but the cluster file's model says {value}")

    # The run state file lies on the pod's own writable emptyDir, which
    # outlives a container restart.
    path = f.get("run_state_file")
    c = runs[EXPERT][0]
    empty_dirs = [v["name"] for v in pod_spec(sts).get("volumes") or [] if "emptyDir" in v]
    ok = [vm for vm in c.get("volumeMounts") or [] if vm["name"] in empty_dirs and
          not vm.get("readOnly") and path and
          os.path.dirname(path) == vm["mountPath"].rstrip("/")]
    C.check(ok, f"{EXPERT}: --run_state_file={path} is not on a writable emptyDir mount")

    # Router and trainer read the generated ConfigMap (its hashed name).
    for comp in (ROUTER, TRAINER):
        w, (c, _, f) = workloads[comp], runs[comp]
        path = f.get("cluster")
        mounted = False
        for vm in c.get("volumeMounts") or []:
            vol = next((v for v in pod_spec(w).get("volumes") or [] if v["name"] == vm["name"]),
                       None)
            if vol and "configMap" in vol and path and \
                    os.path.dirname(path) == vm["mountPath"].rstrip("/"):
                C.check(vol["configMap"]["name"] == cm["metadata"]["name"],
                        f"{comp}: volume {vol['name']} refers to ConfigMap "
                        f"{vol['configMap']['name']}, the generated one is "
                        f"{cm['metadata']['name']}")
                C.check(os.path.basename(path) in (cm.get("data") or {}),
                        f"{comp}: --cluster={path}: no key {os.path.basename(path)} in the "
                        "ConfigMap")
                mounted = True
        C.check(mounted, f"{comp}: --cluster={path} is not in a mounted ConfigMap")

    # The trainer: cluster experts, a model that fits the cluster file, checkpoints on the PVC.
    f = runs[TRAINER][2]
    C.check(f.get("experts") == "cluster", f"{TRAINER}: --experts={f.get('experts')}, want "
                                           "cluster (the expert-group services)")
    n_layer, moe_every = int(f.get("n_layer", 4)), int(f.get("moe_every", 1))
    moe_layers = n_layer if moe_every == 1 else n_layer // 2
    C.check(moe_layers == m.num_layers,
            f"{TRAINER}: --n_layer={n_layer} --moe_every={moe_every} gives {moe_layers} MoE "
            f"layers, the cluster file's model.num_layers is {m.num_layers}")
    C.check(m.d_model % int(f.get("n_head", 4)) == 0,
            f"{TRAINER}: --n_head={f.get('n_head', 4)} does not divide d_model {m.d_model}")
    C.check(int(f.get("checkpoint_every", 0)) > 0,
            f"{TRAINER}: --checkpoint_every={f.get('checkpoint_every', 0)}: no checkpoints")
    out_dir = f.get("out_dir", "runs/latest")
    c = runs[TRAINER][0]
    pvc_name = pvc["metadata"]["name"]
    vols = [v["name"] for v in pod_spec(job).get("volumes") or []
            if (v.get("persistentVolumeClaim") or {}).get("claimName") == pvc_name]
    mounts = [vm for vm in c.get("volumeMounts") or [] if vm["name"] in vols]
    ok = [vm for vm in mounts if not vm.get("readOnly") and
          os.path.commonpath([vm["mountPath"], os.path.join(out_dir, "checkpoints")])
          == vm["mountPath"].rstrip("/")]
    C.check(os.path.isabs(out_dir) and ok,
            f"{TRAINER}: --out_dir={out_dir} (checkpoints in {out_dir}/checkpoints) is not on "
            f"the writable mount of PVC {pvc_name} (mounts: "
            f"{[vm['mountPath'] for vm in mounts]})")
    C.check("ReadWriteOnce" in pvc["spec"].get("accessModes", []) or
            "ReadWriteMany" in pvc["spec"].get("accessModes", []),
            f"PVC {pvc_name}: accessModes {pvc['spec'].get('accessModes')}")
    C.check(job["spec"]["template"]["spec"].get("restartPolicy") in ("OnFailure", "Never"),
            f"{TRAINER}: a Job's restartPolicy must be OnFailure or Never")

    # One image for every container; the user the Dockerfile creates.
    images = {c["image"] for w in workloads.values() for c in pod_spec(w)["containers"]}
    C.check(len(images) == 1, f"containers run different images: {sorted(images)}")
    for comp, w in workloads.items():
        sc = pod_spec(w).get("securityContext") or {}
        C.check(sc.get("runAsUser") == DOCKER_UID,
                f"{comp}: runAsUser {sc.get('runAsUser')}, the image's user is {DOCKER_UID}")


def check_mtls(objs):
    """overlays/mtls: every gRPC server and client gets --tls_ca/cert/key from its
    own Secret himoe-<workload>-tls mounted read-only, the experts the roles and
    no --insecure_training, and no probe is a gRPC one (the kubelet's cannot
    present a client certificate)."""
    want = {"--tls_ca": "/etc/himoe-tls/ca.pem", "--tls_cert": "/etc/himoe-tls/tls.pem",
            "--tls_key": "/etc/himoe-tls/tls.key"}
    for kind, name, secret in (("StatefulSet", EXPERT, "himoe-expert-tls"),
                               ("Deployment", ROUTER, "himoe-router-tls"),
                               ("Job", TRAINER, "himoe-trainer-tls")):
        w = one(objs, kind, name)
        if w is None:
            continue
        spec = pod_spec(w)
        c = spec["containers"][0]
        flags = parse_flags(c.get("args") or [])
        if name == EXPERT:
            roles = {"trainer_identity": "spiffe://himoe/trainer",
                     "router_identity": "spiffe://himoe/router", "insecure_training": "false"}
            for flag, value in roles.items():
                C.check(flags.get(flag) == value,
                        f"{name}: --{flag}={flags.get(flag)}, expected {value}")
        for flag, path in want.items():
            C.check(flags.get(flag.lstrip("-")) == path,
                    f"{name}: {flag}={flags.get(flag.lstrip('-'))}, expected {path}")
        mounts = [m for m in c.get("volumeMounts") or [] if m.get("mountPath") == "/etc/himoe-tls"]
        C.check(len(mounts) == 1 and mounts[0].get("readOnly") is True,
                f"{name}: /etc/himoe-tls is not mounted read-only once: {mounts}")
        volume = {v["name"]: v for v in spec.get("volumes") or []}.get(
            mounts[0]["name"] if mounts else "")
        C.check(volume is not None and (volume.get("secret") or {}).get("secretName") == secret,
                f"{name}: /etc/himoe-tls is not the Secret {secret}: {volume}")
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            pr = c.get(probe)
            if pr is None:
                continue
            C.check("grpc" not in pr and "tcpSocket" in pr,
                    f"{name}: {probe} must be a TCP check under mTLS, is {sorted(pr)}")


def check_data_parallel(objs, stubs):
    """overlays/data-parallel: the trainer Job as an Indexed Job of WORLD_SIZE
    ranks. RANK is each pod's completion index, MASTER_ADDR names the pod of
    index 0 through a headless Service that selects the trainer pods and
    serves MASTER_PORT, the container exposes that port, the checkpoint volume
    is ReadWriteMany, and each rank's wrapper execs himoe-trainer with that
    environment."""
    job = one(objs, "Job", TRAINER)
    pvc = one(objs, "PersistentVolumeClaim", "himoe-checkpoints")
    if job is None or pvc is None:
        return
    spec, pod = job["spec"], pod_spec(job)
    c = pod["containers"][0]
    env = {e["name"]: e for e in c.get("env") or []}
    C.check(spec.get("completionMode") == "Indexed",
            f"{TRAINER}: completionMode {spec.get('completionMode')}, expected Indexed")
    world = str(env.get("WORLD_SIZE", {}).get("value", ""))
    if not C.check(world.isdigit() and int(world) >= 2,
                   f"{TRAINER}: WORLD_SIZE {world!r}, expected a rank count >= 2"):
        return
    world = int(world)
    C.check(spec.get("completions") == world and spec.get("parallelism") == world,
            f"{TRAINER}: completions {spec.get('completions')}, parallelism "
            f"{spec.get('parallelism')}; every one of the {world} ranks must run at once")
    rank_field = env.get("RANK", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    C.check(rank_field == f"metadata.annotations['{COMPLETION_INDEX}']",
            f"{TRAINER}: RANK comes from {rank_field}, expected the completion index")
    subdomain = pod.get("subdomain")
    master = env.get("MASTER_ADDR", {}).get("value")
    C.check(subdomain and master == f"{job['metadata']['name']}-0.{subdomain}",
            f"{TRAINER}: MASTER_ADDR {master!r} is not the pod of index 0 "
            f"({job['metadata']['name']}-0.{subdomain})")
    svc = one(objs, "Service", subdomain) if subdomain else None
    port = str(env.get("MASTER_PORT", {}).get("value", ""))
    if svc is not None:
        C.check(svc["spec"].get("clusterIP") == "None",
                f"Service {subdomain}: clusterIP {svc['spec'].get('clusterIP')}, the ranks' "
                "names need a headless Service")
        C.check(matches(svc["spec"].get("selector"), pod_labels(job)),
                f"Service {subdomain}: selector does not select the trainer pods")
        by_name = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        targets = [by_name.get(p.get("targetPort")) if isinstance(p.get("targetPort"), str)
                   else p.get("targetPort", p["port"]) for p in svc["spec"].get("ports") or []]
        C.check(port.isdigit() and int(port) in targets and int(port) in by_name.values(),
                f"{TRAINER}: MASTER_PORT {port!r} is not a port the container and Service "
                f"{subdomain} serve ({by_name}, {targets})")
    C.check("ReadWriteMany" in (pvc["spec"].get("accessModes") or []),
            f"PersistentVolumeClaim himoe-checkpoints: accessModes "
            f"{pvc['spec'].get('accessModes')}; every rank mounts it")
    # Each rank's wrapper hands its rank and the rendezvous to himoe-trainer.
    cm = one(objs, "ConfigMap", "himoe-cluster", prefix=True)
    text = ((cm or {}).get("data") or {}).get("cluster.textproto", "")
    work = tempfile.mkdtemp(prefix="k8s-manifest-test-ranks-")
    cluster = os.path.join(work, "cluster.textproto")
    with open(cluster, "w") as fh:
        fh.write(re.sub(r'(groups\s*\{[^}]*address:\s*")[^"]+"', r'\g<1>127.0.0.1:1"', text))
    flags = parse_flags(c.get("args") or [])
    arg_map = {f"--cluster={flags.get('cluster')}": f"--cluster={cluster}",
               f"--out_dir={flags.get('out_dir')}": f"--out_dir={os.path.join(work, 'run')}"}
    for r in range(world):
        binary, _ = run_container(c, f"{TRAINER}-{r}-k2x9p", stubs, arg_map=arg_map,
                                  extra_env={"HIMOE_WAIT_S": "0"},
                                  annotations={COMPLETION_INDEX: str(r)})
        if binary is None:
            continue
        seen = dict(line.split("=", 1) for line in
                    open(os.path.join(stubs, "argv.txt.env")).read().splitlines() if "=" in line)
        want = {"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": master,
                "MASTER_PORT": port}
        C.check(all(seen.get(k) == v for k, v in want.items()),
                f"{TRAINER}-{r}: himoe-trainer ran with "
                f"{ {k: seen.get(k) for k in want} }, expected {want}")
    shutil.rmtree(work, ignore_errors=True)


def check_trainer_command(c, cluster_text, stubs):
    """Runs the trainer's wrapper: it must wait for every group of the cluster
    file and add --resume only when a complete checkpoint exists."""
    flags = parse_flags([a for a in c.get("args") or []])
    cluster_path, out_dir = flags.get("cluster"), flags.get("out_dir")
    if not C.check(cluster_path and out_dir, f"{TRAINER}: --cluster and --out_dir are needed"):
        return None, {}
    work = tempfile.mkdtemp(prefix="k8s-manifest-test-trainer-")
    # The groups, as local listeners: the wrapper must connect to each.
    listeners, text = [], cluster_text
    for addr in re.findall(r'address:\s*"([^"]+)"', cluster_text):
        if addr.startswith("0.0.0.0"):
            continue  # router.address
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        listeners.append((addr, s))
        text = text.replace(f'"{addr}"', f'"127.0.0.1:{s.getsockname()[1]}"')
    local_cluster = os.path.join(work, "cluster.textproto")
    with open(local_cluster, "w") as fh:
        fh.write(text)
    local_out = os.path.join(work, "run")
    arg_map = {f"--cluster={cluster_path}": f"--cluster={local_cluster}",
               f"--out_dir={out_dir}": f"--out_dir={local_out}"}
    pod = f"{TRAINER}-q8x2z"
    final = {}
    cases = [("no checkpoint", None, False),
             ("an incomplete checkpoint", "step_00000100.tmp-x1y2z3/MANIFEST", False),
             ("a checkpoint without MANIFEST", "step_00000100/meta.textproto", False),
             ("a complete checkpoint", "step_00000100/MANIFEST", True)]
    binary = None
    for i, (what, file, resume) in enumerate(cases):
        if file:
            path = os.path.join(local_out, "checkpoints", file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
        binary, argv = run_container(c, pod, stubs, extra_env={"HIMOE_WAIT_S": "20"},
                                     arg_map=arg_map, annotations={COMPLETION_INDEX: "0"})
        if binary is None:
            return None, {}
        C.check(("--resume" in argv) == resume,
                f"{TRAINER}: with {what} in --out_dir the wrapper runs "
                f"{'with' if '--resume' in argv else 'without'} --resume")
        if i == 0:
            final = parse_flags([a for a in argv if a != "--resume"])
            final.update({"cluster": cluster_path, "out_dir": out_dir})
            for addr, s in listeners:  # each group got a connection (it waited for it)
                s.setblocking(False)
                try:
                    conn, _ = s.accept()
                    conn.close()
                    got = True
                except BlockingIOError:
                    got = False
                C.check(got, f"{TRAINER}: the wrapper did not wait for group {addr} of the "
                             "cluster file")
    parsed = parse_cluster(cluster_text)
    C.check(parsed is not None and len(listeners) == len(parsed.groups),
            f"{TRAINER}: test set-up: {len(listeners)} group addresses found in the cluster "
            "file, expected one per groups entry")
    for _, s in listeners:
        s.close()
    shutil.rmtree(work, ignore_errors=True)
    return binary, final


# ------------------------------------------------------------- Dockerfile

def dockerfile_stages(path):
    text = open(path).read()
    # Join continuation lines; drop comments.
    logical, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#") or (not s and not cur):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        logical.append(cur + s)
        cur = ""
    stages = []
    for ins in logical:
        word, _, rest = ins.partition(" ")
        if word.upper() == "FROM":
            parts = rest.split()
            stages.append({"image": parts[0],
                           "name": parts[2] if len(parts) > 2 and parts[1].upper() == "AS"
                           else None, "ins": []})
        elif stages:
            stages[-1]["ins"].append((word.upper(), rest))
    return stages


def docker_uid():
    stages = dockerfile_stages(DOCKERFILE)
    users = [r for k, r in stages[-1]["ins"] if k == "USER"] if stages else []
    try:
        return int(users[-1].split(":")[0]) if users else None
    except ValueError:
        return users[-1]


DOCKER_UID = None


def check_dockerfile(build_dir):
    C.where = "Dockerfile"
    if not C.check(os.path.exists(DOCKERFILE), f"{DOCKERFILE} is missing"):
        return
    stages = dockerfile_stages(DOCKERFILE)
    C.check(len(stages) >= 2, f"expected a multi-stage build, has {len(stages)} FROM")
    if len(stages) < 2:
        return
    for s in stages:
        C.check(re.fullmatch(r"debian:bookworm(-slim)?(@sha256:[0-9a-f]+)?", s["image"]),
                f"stage {s['name']}: FROM {s['image']}, expected debian:bookworm[-slim]")
    build, runtime = stages[0], stages[-1]
    C.check(build["image"].startswith("debian:bookworm") and
            not build["image"].startswith("debian:bookworm-slim"),
            f"the build stage should be FROM debian:bookworm, is {build['image']}")
    runs = " ".join(r for k, r in build["ins"] if k == "RUN")
    C.check(re.search(r"(^|[\s/])scripts/setup\.sh\b", runs) is not None,
            "the build stage does not run scripts/setup.sh")
    C.check(any(k == "COPY" and (r.split()[0] == "." or r.startswith(". ")) for k, r in
                build["ins"]), "the build stage does not COPY the sources (COPY . ...)")
    # The binaries: copied from the build tree into the runtime image's PATH.
    copies = [r for k, r in runtime["ins"] if k == "COPY" and
              r.startswith(f"--from={build['name']}")]
    C.check(any(r.split()[-1].rstrip("/") == "/usr/local/bin" for r in copies),
            "the runtime stage does not COPY --from=build into /usr/local/bin")
    for binary, subdir in list(BINARIES.items()) + [("himoe-cluster", "deploy/local")]:
        C.check(f"build/{subdir}/{binary}" in runs,
                f"the build stage does not collect build/{subdir}/{binary}")
        if build_dir:
            C.check(os.access(os.path.join(build_dir, subdir, binary), os.X_OK),
                    f"{build_dir}/{subdir}/{binary} is missing: build it first (the "
                    "Dockerfile's path must be the build tree's)")
    # Runtime packages.
    pkgs = set()
    for k, r in runtime["ins"]:
        if k != "RUN":
            continue
        for cmd in re.split(r"&&|;|\|\|", r):
            words = cmd.split()
            if "apt-get" in words and "install" in words:
                pkgs |= {w for w in words[words.index("install") + 1:] if not w.startswith("-")}
    C.check(pkgs, "the runtime stage installs no packages (apt-get install)")
    for needed in ("fortunes-min", "libblis4-openmp"):
        C.check(needed in pkgs, f"runtime packages lack {needed}")
    if build_dir:
        check_runtime_libraries(build_dir, pkgs)
    ignore = os.path.join(REPO, ".dockerignore")
    if C.check(os.path.exists(ignore), ".dockerignore is missing (build trees would be sent)"):
        entries = {l.strip().lstrip("/") for l in open(ignore) if l.strip() and
                   not l.startswith("#")}
        C.check({"build", "build-*"} <= entries or "build*" in entries,
                f".dockerignore does not leave out build/ and build-*/ ({sorted(entries)})")


def check_runtime_libraries(build_dir, pkgs):
    """Every library a binary needs directly belongs to a runtime package."""
    if not C.check(shutil.which("dpkg") and shutil.which("readelf") and shutil.which("ldd"),
                   "dpkg, readelf and ldd are needed to check the runtime packages"):
        return
    found = []  # (binary, library, resolved path)
    for binary, subdir in list(BINARIES.items()) + [("himoe-cluster", "deploy/local")]:
        path = os.path.join(build_dir, subdir, binary)
        if not os.path.exists(path):
            continue
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                            subprocess.run(["readelf", "-d", path], capture_output=True,
                                           text=True).stdout)
        resolved = dict(re.findall(r"^\s*(\S+) => (\S+)", subprocess.run(
            ["ldd", path], capture_output=True, text=True).stdout, re.M))
        for lib in needed:
            where = resolved.get(lib)
            if C.check(where and where != "not", f"{binary}: {lib} does not resolve"):
                found.append((binary, lib, where))
    # One dpkg -S for every path (and the file each symlink ends at).
    paths = sorted({p for _, _, w in found for p in (w, os.path.realpath(w))})
    owners = {}
    for line in subprocess.run(["dpkg", "-S"] + paths, capture_output=True,
                               text=True).stdout.splitlines():
        pkg, _, p = line.rpartition(": ")
        owners[p] = pkg.split(",")[0].split(":")[0].strip()
    for binary, lib, where in found:
        owner = owners.get(where) or owners.get(os.path.realpath(where))
        C.check(owner in pkgs | BASE_IMAGE_PACKAGES,
                f"{binary} needs {lib} ({where}, package {owner}), which the runtime "
                "stage does not install")


# ------------------------------------------------------------------ main

def main():
    global DOCKER_UID
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kubectl", action="append",
                    help="kubectl to render with (repeatable); default: kubectl on PATH")
    ap.add_argument("--build-dir", help="a build tree: check the Dockerfile's binary paths and "
                                        "runtime packages against it")
    a = ap.parse_args()
    kubectls = a.kubectl or [shutil.which("kubectl")]
    missing = [k or "kubectl (on PATH)" for k in kubectls if not k or not os.access(k, os.X_OK)]
    if missing:
        print(f"FAIL: {', '.join(missing)} not found. kubectl renders the manifests (kubectl "
              "kustomize); scripts/setup.sh installs it (Debian package kubernetes-client).")
        return 1
    DOCKER_UID = docker_uid()
    check_dockerfile(a.build_dir)
    stubs = tempfile.mkdtemp(prefix="k8s-manifest-test-stubs-")
    for b in list(BINARIES) + ["himoe-cluster"]:
        p = os.path.join(stubs, b)
        with open(p, "w") as fh:
            fh.write(STUB)
        os.chmod(p, 0o755)
    for kubectl in kubectls:
        version = kubectl_version(kubectl)
        for variant, directory in VARIANTS.items():
            C.where = f"{version}: {os.path.relpath(directory, REPO)}"
            print(f"rendering {os.path.relpath(directory, REPO)} with {version}")
            objs = render(kubectl, directory)
            if objs is not None:
                check_variant(objs, variant, stubs)
                if variant == "data-parallel":
                    check_data_parallel(objs, stubs)
        mtls = os.path.join(K8S, "overlays", "mtls")
        C.where = f"{version}: {os.path.relpath(mtls, REPO)}"
        print(f"rendering {os.path.relpath(mtls, REPO)} with {version}")
        objs = render(kubectl, mtls)
        if objs is not None:
            check_mtls(objs)
    shutil.rmtree(stubs, ignore_errors=True)
    for f in C.failures:
        print(f"FAIL {f}")
    print(f"{C.passed} checks passed, {len(C.failures)} failed")
    return 1 if C.failures else 0


if __name__ == "__main__":
    sys.exit(main())
