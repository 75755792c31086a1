#!/usr/bin/python3
"""Every query of the Grafana dashboard against a real Prometheus.

Starts, on 127.0.0.1 with free ports: a local cluster (himoe-cluster: 4
himoe-expert groups and a himoe-router) of a tiny model, Prometheus with the
checked-in deploy/prometheus/prometheus.yml and its recording rules (only the
target addresses and the intervals changed), a short himoe-trainer run against
the cluster, and RouteForward calls to the router meanwhile (plus one bad
request, an error to count). Then:

  - promtool check metrics on every /metrics endpoint (router, each group,
    the trainer) and promtool check config on the config Prometheus ran;
  - each templating variable query of deploy/grafana/himoe.json, through the
    HTTP API: it must give values;
  - each PromQL expression of each panel, with the variables set as Grafana
    would (All for multi-value ones, every value for single-value and repeat
    variables, $__rate_interval = 1m), as an instant query at the last
    moment Prometheus scraped the trainer: it must return a series with a
    value that is not NaN. A panel whose query returns nothing fails the test.

Every process it starts is stopped on every path (SIGTERM, then SIGKILL).
Run with the system interpreter (python3-yaml, python3-grpcio, numpy):

  /usr/bin/python3 tests/deploy/prometheus_dashboard_test.py --source_root . \
      --cluster build/deploy/local/himoe-cluster \
      --expert build/expert_service/himoe-expert \
      --router build/router_service/himoe-router \
      --trainer build/trainer/himoe-trainer
"""

import argparse
import ctypes
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml

# The stubs python_client.py generates come from an old grpc_tools; the
# pure-Python protobuf runtime accepts them whatever protobuf is installed.
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

RATE_INTERVAL = "1m"  # $__rate_interval for a 15 s datasource scrape interval
JOBS = ("himoe-router", "himoe-expert", "himoe-trainer")
NUM_LAYERS = 2
NUM_GROUPS = 4
D_MODEL = 64
TRAIN_STEPS = 400  # long enough for tens of scrapes of the trainer
MIN_TRAINER_SCRAPES = 5


class Failure(Exception):
    pass


def log(msg):
    print(msg, flush=True)


# --- processes ------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    # Only in processes started before this script has other threads.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Processes:
    """The services this test runs; stop_all() ends each (SIGTERM, then SIGKILL)."""

    def __init__(self):
        self.procs = []  # (name, Popen, log path)

    def start(self, name, argv, log_path):
        out = open(log_path, "wb")
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        out.close()
        self.procs.append((name, proc, log_path))
        return proc

    def stop_all(self):
        for name, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    log("%s did not stop on SIGTERM; SIGKILL" % name)
                    proc.kill()
                    proc.wait()

    def log_tails(self, lines=25):
        out = []
        for name, _, path in self.procs:
            try:
                with open(path, errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError as e:
                tail = ["(%s)" % e]
            out.append("--- %s (%s):\n%s" % (name, path, "\n".join("    | " + l for l in tail)))
        return "\n".join(out)


def wait_for(what, predicate, timeout, procs=(), poll=0.25):
    """Polls predicate() until it is truthy; fails if one of procs ends first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for name, proc in procs:
            if proc.poll() is not None:
                raise Failure("%s exited (%d) while waiting for %s" % (name, proc.returncode, what))
        if time.monotonic() > deadline:
            raise Failure("timed out after %d s waiting for %s" % (timeout, what))
        time.sleep(poll)


def http_get(url, timeout=5):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError):
        return None


# --- Prometheus -----------------------------------------------------------------

class Prometheus:
    def __init__(self, port):
        self.base = "http://127.0.0.1:%d" % port

    def api(self, path, **params):
        url = "%s/api/v1/%s?%s" % (self.base, path, urllib.parse.urlencode(params, doseq=True))
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise Failure("%s %s: %s: %s" % (path, params, body.get("errorType"), body.get("error")))
        return body["data"]

    def query(self, expr, t):
        return self.api("query", query=expr, time="%.3f" % t)


def prometheus_config(checked_in, rules_dir, targets):
    """The checked-in config with the test's targets and 1 s intervals."""
    with open(checked_in) as f:
        cfg = yaml.safe_load(f)
    jobs = [c["job_name"] for c in cfg["scrape_configs"]]
    if sorted(jobs) != sorted(JOBS):
        raise Failure("%s has jobs %s; this test knows %s" % (checked_in, jobs, list(JOBS)))
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    cfg["rule_files"] = [os.path.join(rules_dir, p) for p in cfg.get("rule_files", [])]
    for c in cfg["scrape_configs"]:
        c["static_configs"] = [{"targets": targets[c["job_name"]]}]
    return cfg


# --- Grafana variables -----------------------------------------------------------

LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+?)\s*,\s*)?([a-zA-Z_]\w*)\s*\)\s*$")
VAR_REF = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]")
BUILTINS = {"__rate_interval": RATE_INTERVAL, "__interval": "15s", "__range": "5m"}


def regex_escape(v):
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\1", v)


def variable_values(prom, var, start, end):
    query = var.get("query")
    if isinstance(query, dict):
        query = query.get("query", "")
    m = LABEL_VALUES.match(query or "")
    if not m:
        raise Failure("variable %s: query %r is not label_values(...), which this test reads"
                      % (var["name"], query))
    params = {"start": "%.3f" % start, "end": "%.3f" % end}
    if m.group(1):
        params["match[]"] = m.group(1)
    values = prom.api("label/%s/values" % m.group(2), **params)
    if var.get("regex"):
        values = [v for v in values if re.search(var["regex"], v)]
    if var.get("sort") in (3, 4):
        values.sort(key=float, reverse=var["sort"] == 4)
    elif var.get("sort") in (1, 2):
        values.sort(reverse=var["sort"] == 2)
    return query, values


def expand(expr, variables, repeat):
    """Every instance of expr with its variables replaced: the cartesian product
    over single-value (and the repeat) variables, All for multi-value ones."""
    names = []
    for m in VAR_REF.finditer(expr):
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in names:
            names.append(name)
    choices = []
    for name in names:
        if name in BUILTINS:
            choices.append([(name, BUILTINS[name])])
            continue
        if name not in variables:
            raise Failure("unknown variable $%s in %r" % (name, expr))
        var, values = variables[name]
        if name != repeat and (var.get("multi") or var.get("includeAll")):
            choices.append([(name, "(%s)" % "|".join(regex_escape(v) for v in values))])
        else:
            choices.append([(name, v) for v in values])
    out = []
    for combo in itertools.product(*choices):
        subst = dict(combo)
        text = VAR_REF.sub(lambda m: subst[m.group(1) or m.group(2) or m.group(3)], expr)
        label = ", ".join("$%s=%s" % (k, v) for k, v in combo
                          if k not in BUILTINS and len(v) < 40)
        out.append((text, label))
    return out


def flatten_panels(panels):
    for p in panels:
        yield p
        yield from flatten_panels(p.get("panels", []))


def count_exprs(node):
    if isinstance(node, dict):
        return int("expr" in node) + sum(count_exprs(v) for v in node.values())
    if isinstance(node, list):
        return sum(count_exprs(v) for v in node)
    return 0


def has_data(result):
    """(ok, series count, a sample value) of an instant query's data."""
    kind, value = result["resultType"], result["result"]
    if kind == "scalar":
        samples = [value[1]]
    elif kind == "vector":
        samples = [s["value"][1] for s in value]
    else:
        samples = [v[1] for s in value for v in s.get("values", [])]
    finite = [float(s) for s in samples if not math.isnan(float(s))]
    return bool(finite), len(samples), (finite[0] if finite else None)


def check_dashboard_shape(dash):
    if dash.get("schemaVersion", 0) < 36:
        raise Failure("dashboard schemaVersion %s < 36" % dash.get("schemaVersion"))
    ds = [v for v in dash["templating"]["list"] if v.get("type") == "datasource"]
    if not ds or ds[0].get("query") != "prometheus":
        raise Failure("the dashboard needs a datasource variable of type prometheus")
    ids = [p["id"] for p in flatten_panels(dash["panels"])]
    if len(ids) != len(set(ids)):
        raise Failure("duplicate panel ids: %s" % ids)
    for p in flatten_panels(dash["panels"]):
        for t in [p] + p.get("targets", []):
            uid = (t.get("datasource") or {}).get("uid")
            if p["type"] != "row" and uid != "${%s}" % ds[0]["name"]:
                raise Failure("panel %r: datasource %r is not the variable" % (p["title"], uid))


# --- the run ----------------------------------------------------------------------

def cluster_file(path, ports):
    groups = "".join(
        'groups { address: "127.0.0.1:%d" threads: 1 metrics_port: %d }\n'
        % (ports["expert"][g], ports["expert_metrics"][g]) for g in range(NUM_GROUPS))
    with open(path, "w") as f:
        f.write(
            "model { num_layers: %d d_model: %d d_ff: 128 num_experts: 8 num_groups: %d "
            "top_k: 1 seed: 1 }\n"
            'routing { method: "himoe" preset: "paper" }\n'
            "%s"
            'router { address: "127.0.0.1:%d" metrics_port: %d }\n'
            % (NUM_LAYERS, D_MODEL, NUM_GROUPS, groups, ports["router"], ports["router_metrics"]))


class RouterTraffic(threading.Thread):
    """RouteForward on every layer until stopped, and one request of the wrong
    width (INVALID_ARGUMENT, an error for the errors panel)."""

    def __init__(self, source_root, address, stub_dir):
        super().__init__(daemon=True)
        sys.path.insert(0, os.path.join(source_root, "tests", "router_service"))
        import python_client  # noqa: E402 (needs the path above)
        self.client = python_client
        self.stub = python_client.connect(address, os.path.join(source_root, "proto"), stub_dir)
        self.stop = threading.Event()
        self.calls = 0
        self.error = None
        self.rejected = None

    def run(self):
        import grpc
        import numpy as np
        rng = np.random.default_rng(0)
        try:
            try:
                self.client.route_forward(self.stub, 0, np.zeros((2, D_MODEL + 1), np.float32))
            except grpc.RpcError as e:
                self.rejected = e.code().name
            while not self.stop.is_set():
                for layer in range(NUM_LAYERS):
                    x = rng.standard_normal((16, D_MODEL)).astype(np.float32)
                    self.client.route_forward(self.stub, layer, x)
                    self.calls += 1
                self.stop.wait(0.2)
        except Exception as e:  # reported by the main thread
            self.error = e


def promtool_check_metrics(promtool, name, body):
    r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        raise Failure("promtool check metrics on %s:\n%s%s" % (name, r.stdout, r.stderr))
    log("promtool check metrics: %s OK (%d lines)" % (name, body.count("\n")))


def run(args, tmp, procs):
    src = os.path.abspath(args.source_root)
    with open(os.path.join(src, "deploy", "grafana", "himoe.json")) as f:
        dash = json.load(f)
    check_dashboard_shape(dash)

    sys.path.insert(0, os.path.join(src, "scripts"))
    from loopback_ports import free_ports  # noqa: E402 (needs the path above)
    p = free_ports(2 * NUM_GROUPS + 4)
    ports = {"router": p[0], "router_metrics": p[1], "trainer_metrics": p[2],
             "prometheus": p[3], "expert": p[4:4 + NUM_GROUPS],
             "expert_metrics": p[4 + NUM_GROUPS:]}
    endpoints = {"router": ports["router_metrics"], "trainer": ports["trainer_metrics"]}
    for g in range(NUM_GROUPS):
        endpoints["expert group %d" % g] = ports["expert_metrics"][g]

    # The cluster; the launcher finds himoe-expert and himoe-router in bin_dir.
    cluster = os.path.join(tmp, "cluster.textproto")
    cluster_file(cluster, ports)
    bin_dir = os.path.join(tmp, "bin")
    os.mkdir(bin_dir)
    os.symlink(os.path.abspath(args.expert), os.path.join(bin_dir, "himoe-expert"))
    os.symlink(os.path.abspath(args.router), os.path.join(bin_dir, "himoe-router"))
    cluster_log = os.path.join(tmp, "himoe-cluster.log")
    launcher = procs.start("himoe-cluster", [
        args.cluster, "--cluster=" + cluster, "--bin_dir=" + bin_dir,
        "--log_dir=" + os.path.join(tmp, "cluster-logs")], cluster_log)
    def cluster_ready():
        with open(cluster_log, errors="replace") as f:
            return "ready." in f.read()
    wait_for("himoe-cluster to be ready", cluster_ready, 120, [("himoe-cluster", launcher)])
    log("cluster ready: router 127.0.0.1:%d, groups %s" % (ports["router"], ports["expert"]))

    # Prometheus with the checked-in config and rules.
    checked_in = os.path.join(src, "deploy", "prometheus", "prometheus.yml")
    targets = {
        "himoe-router": ["127.0.0.1:%d" % ports["router_metrics"]],
        "himoe-expert": ["127.0.0.1:%d" % q for q in ports["expert_metrics"]],
        "himoe-trainer": ["127.0.0.1:%d" % ports["trainer_metrics"]],
    }
    config = os.path.join(tmp, "prometheus.yml")
    with open(config, "w") as f:
        yaml.safe_dump(prometheus_config(checked_in, os.path.dirname(checked_in), targets), f)
    r = subprocess.run([args.promtool, "check", "config", config], capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure("promtool check config %s:\n%s%s" % (config, r.stdout, r.stderr))
    prometheus = procs.start("prometheus", [
        args.prometheus, "--config.file=" + config,
        "--web.listen-address=127.0.0.1:%d" % ports["prometheus"],
        "--storage.tsdb.path=" + os.path.join(tmp, "tsdb"), "--log.level=warn"],
        os.path.join(tmp, "prometheus.log"))
    prom = Prometheus(ports["prometheus"])
    wait_for("Prometheus to be ready", lambda: http_get(prom.base + "/-/ready") is not None, 60,
             [("prometheus", prometheus)])
    start = time.time()

    # Scrapes begin a few seconds after start; the trainer should be seen from
    # its first step.
    def services_up():
        v = prom.query('up{job=~"himoe-router|himoe-expert"} == 1', time.time())["result"]
        return len(v) == 1 + NUM_GROUPS
    wait_for("Prometheus to scrape the router and the groups", services_up, 60,
             [("prometheus", prometheus)])
    log("prometheus on %s scrapes the cluster" % prom.base)

    # A short training against the cluster, with RouteForward traffic meanwhile.
    trainer = procs.start("himoe-trainer", [
        args.trainer, "--experts=cluster", "--cluster=" + cluster, "--n_layer=%d" % NUM_LAYERS,
        "--n_head=2", "--dense_ff=128", "--block_size=32", "--batch_size=4",
        "--steps=%d" % TRAIN_STEPS, "--eval_every=%d" % (TRAIN_STEPS // 2), "--eval_windows=4",
        "--threads=1", "--log_every=20", "--metrics_address=127.0.0.1",
        "--metrics_port=%d" % ports["trainer_metrics"], "--out_dir=" + os.path.join(tmp, "run")],
        os.path.join(tmp, "trainer.log"))
    traffic = RouterTraffic(src, "127.0.0.1:%d" % ports["router"], os.path.join(tmp, "stubs"))
    traffic.start()
    trainer_body = None
    step = re.compile(r"^himoe_trainer_step (\S+)$", re.M)
    deadline = time.monotonic() + 240
    while trainer.poll() is None:
        if time.monotonic() > deadline:
            raise Failure("himoe-trainer still running after 240 s")
        body = http_get("http://127.0.0.1:%d/metrics" % ports["trainer_metrics"], timeout=2)
        m = step.search(body or "")
        if m and float(m.group(1)) >= 1:
            trainer_body = body
        time.sleep(0.5)
    traffic.stop.set()
    traffic.join(timeout=60)
    if trainer.returncode != 0:
        raise Failure("himoe-trainer exited with %d" % trainer.returncode)
    if traffic.error is not None:
        raise Failure("RouteForward traffic: %r" % traffic.error)
    if traffic.rejected != "INVALID_ARGUMENT" or traffic.calls == 0:
        raise Failure("router traffic: %d calls, bad request -> %s" % (traffic.calls,
                                                                        traffic.rejected))
    log("training done (%d steps); %d RouteForward calls, bad request -> %s"
        % (TRAIN_STEPS, traffic.calls, traffic.rejected))

    # promtool check metrics on every endpoint.
    if trainer_body is None:
        raise Failure("never read the trainer's /metrics after its first step")
    promtool_check_metrics(args.promtool, "trainer", trainer_body)
    for name, port in endpoints.items():
        if name == "trainer":
            continue
        body = http_get("http://127.0.0.1:%d/metrics" % port)
        if body is None:
            raise Failure("cannot read %s's /metrics on port %d" % (name, port))
        promtool_check_metrics(args.promtool, name, body)

    # The moment Prometheus last scraped the trainer: its gauges are fresh there.
    def trainer_down():
        v = prom.query('up{job="himoe-trainer"}', time.time())["result"]
        return v and v[0]["value"][1] == "0"
    wait_for("Prometheus to see the trainer end", trainer_down, 60, [("prometheus", prometheus)])
    series = prom.api("query_range", query="himoe_trainer_step", start="%.3f" % start,
                      end="%.3f" % time.time(), step="1")["result"]
    if not series:
        raise Failure("Prometheus never scraped the trainer")
    t_eval = max(v[0] for s in series for v in s["values"])
    scrapes = prom.query('count_over_time(himoe_trainer_step[10m])', t_eval)["result"]
    if not scrapes or int(scrapes[0]["value"][1]) < MIN_TRAINER_SCRAPES:
        raise Failure("Prometheus scraped the trainer %s times, too few for rates; train longer"
                      % (scrapes[0]["value"][1] if scrapes else 0))
    log("queries at t=%.0f, the trainer's last scrape" % t_eval)
    # The bad request is counted under its code.
    bad = prom.query('himoe_router_errors_total{code="INVALID_ARGUMENT"}', t_eval)["result"]
    if not bad or float(bad[0]["value"][1]) < 1:
        raise Failure("himoe_router_errors_total{code=\"INVALID_ARGUMENT\"} is %s after a bad "
                      "request" % (bad[0]["value"][1] if bad else "absent"))

    # Templating variables.
    failures = []
    variables = {}
    for var in dash["templating"]["list"]:
        if var["type"] == "datasource":
            continue
        if var["type"] != "query":
            raise Failure("variable %s: type %s is not read by this test" % (var["name"],
                                                                            var["type"]))
        query, values = variable_values(prom, var, start, t_eval)
        log("variable $%-10s %-60s -> %s" % (var["name"], query, values))
        if not values:
            failures.append("variable $%s: %s returned nothing" % (var["name"], query))
        variables[var["name"]] = (var, values)
    if failures:
        raise Failure("\n".join(failures))

    # Every expression of every panel.
    evaluated = 0
    for panel in flatten_panels(dash["panels"]):
        for target in panel.get("targets", []):
            if "expr" not in target:
                continue
            evaluated += 1
            for expr, label in expand(target["expr"], variables, panel.get("repeat")):
                ok, n, sample = has_data(prom.query(expr, t_eval))
                where = "%r %s%s" % (panel["title"], target["refId"],
                                     " [%s]" % label if label else "")
                log("%-4s %-70s %3d series, e.g. %s" % ("ok" if ok else "FAIL", where, n, sample))
                if not ok:
                    failures.append("panel %s returned %s: %s" % (
                        where, "only NaN" if n else "nothing", expr))
    total = count_exprs(dash)
    if evaluated != total:
        failures.append("evaluated %d panel expressions but the JSON has %d" % (evaluated, total))
    if failures:
        for group in prom.api("rules")["groups"]:
            for rule in group["rules"]:
                if rule.get("health") != "ok":
                    failures.append("rule %s: %s %s" % (rule["name"], rule.get("health"),
                                                        rule.get("lastError", "")))
        raise Failure("%d dashboard queries without data:\n  %s"
                      % (len(failures), "\n  ".join(failures)))
    log("all %d expressions of %s return data" % (evaluated, dash["title"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source_root", required=True)
    for name in ("cluster", "expert", "router", "trainer"):
        parser.add_argument("--" + name, required=True, help="the himoe-%s binary" % name)
    parser.add_argument("--prometheus", default="prometheus")
    parser.add_argument("--promtool", default="promtool")
    args = parser.parse_args()
    args.prometheus = shutil.which(args.prometheus) or args.prometheus
    args.promtool = shutil.which(args.promtool) or args.promtool

    def on_signal(signum, frame):
        raise SystemExit("stopped by signal %d" % signum)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)

    tmp = tempfile.mkdtemp(prefix="himoe-prometheus-test-")
    procs = Processes()
    ok = False
    try:
        run(args, tmp, procs)
        ok = True
    except Failure as e:
        print("FAIL: %s" % e, file=sys.stderr)
    finally:
        procs.stop_all()
        if not ok:
            print(procs.log_tails(), file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    if ok:
        log("PASS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
