#!/usr/bin/python3
"""Chaos runs on the network-namespace testbed that scripts/chaos.sh makes (a
coordinator host and one host per expert group, joined by a switch).

  train   a fault-free training run, then the same run (same seed, flags and
          hosts) under a seeded schedule of faults; the chaos run must end by
          itself, its final checkpoint must be bit-identical to the fault-free
          one (sha256 of every file), its run log must hold every step once
          with the fault-free run's losses, and the figures (detection,
          recovery, time lost a fault against the theoretical) are printed
          and written as Markdown (--out).
  serve   a router serving a short training run's checkpoint, under
          RouteForward and Generate load from scripts/chaos_load.py (in the
          coordinator host) for --seconds, a fault every --interval s; every
          answer must equal the in-process reference
          (tests/trainer/himoe_serve_reference) or be a clear status naming
          the group (or, while the router itself is down, the client's own),
          no call may outlive the deadline, memory must stay flat and serving
          must resume within --resume_s of each return.

The schedule is (trigger, target, fault, duration) from --seed: the same
seed replays the same faults. A fault fires once the run has reached its
trigger (train: a step; serve: seconds of load); faults that share a
trigger overlap. Faults:

  expert_kill, expert_term   SIGKILL / SIGTERM an expert process; it is started
                             again on its address after the duration (train:
                             on its --run_state_file, unless --run_state 0)
  expert_stop                SIGSTOP an expert process, SIGCONT after it
  trainer_kill, trainer_term SIGKILL / SIGTERM the trainer; it is started again
                             with --resume (as a Job controller would)
  trainer_stop               SIGSTOP the trainer, SIGCONT after it
  router_kill, router_term   SIGKILL / SIGTERM the router; started again on its
                             address after the duration (serve)
  router_stop                SIGSTOP the router, SIGCONT after it (serve)
  link_down                  a host's switch port down, up after it
  link_trickle               a host's link shaped to 16 kbit/s both ways
  conn_kill                  every TCP connection of a group's port destroyed
                             (ss -K: the peers get a reset)

Needs root (run it through scripts/chaos.sh) and /usr/bin/python3.
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostinfo import cpu_model, rss_mib  # noqa: E402
from proc_util import stop_processes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERT_PORT = 50091
TRAIN_KINDS = ("expert_kill", "expert_term", "expert_stop", "trainer_kill", "trainer_term",
               "trainer_stop", "link_down", "link_trickle", "conn_kill")
# Train-record fields that measure time, not the step's arithmetic.
TIMING_FIELDS = {"seconds", "tokens_per_s", "gflops", "forward_wait_s", "forward_straggler_s"}


class Fault:
    def __init__(self, index, step, target, kind, duration):
        self.index, self.step, self.target, self.kind = index, step, target, kind
        self.duration = duration
        self.unit = "step"     # what self.step counts: "step" or "s" (serve: seconds of load)
        self.fired = None      # time injected
        self.restored = None   # time the target was back (started, continued, link up)
        self.detected = None   # time of the first clear error after it
        self.recovered = None  # time of the first step after it was restored

    def describe(self):
        at = f"step {self.step:4d}" if self.unit == "step" else f"at {self.step:4d} s"
        return f"#{self.index:02d} {at}  {self.kind:<13} {self.target:<8} {self.duration:.1f} s"


def make_schedule(seed, count, steps, groups, kinds, spaced=False):
    """count faults over steps [5, steps - 5] (spaced: one every
    steps / (count + 1)), every kind at least once when count allows; about
    one in four shares the previous fault's step (overlapping) on another
    target."""
    rng = random.Random(seed)
    chosen = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(chosen)
    triggers = sorted(rng.randint(5, max(6, steps - 5)) for _ in range(count))
    if spaced:
        triggers = [(i + 1) * steps // (count + 1) for i in range(count)]
    faults = []
    for i, kind in enumerate(chosen):
        if kind.startswith(("trainer", "router")):
            target = kind.split("_")[0]
        elif kind.startswith("link") and rng.random() < 0.25:
            target = "coord"
        else:
            target = f"group{rng.randrange(groups)}"
        duration = 0.0 if kind in ("trainer_kill", "trainer_term", "conn_kill") else \
            round(rng.uniform(0.5, 3.0), 1)
        step = triggers[i]
        if faults and rng.random() < 0.25 and faults[-1].target != target:
            step = faults[-1].step
        faults.append(Fault(i, step, target, kind, duration))
    faults.sort(key=lambda f: (f.step, f.index))
    for i, f in enumerate(faults):
        f.index = i
    return faults


class Testbed:
    """The namespaces chaos.sh made: the coordinator, host g for group g, and
    the switch whose port0 is the coordinator's, port<g+1> host g's."""

    def __init__(self, a):
        self.switch, self.coord, self.coord_ip = a.switch, a.coord, a.coord_ip
        self.hosts = a.hosts.split(",")
        self.host_ips = a.host_ips.split(",")
        self.work = a.work

    def ns(self, target):
        return self.coord if target == "coord" else self.hosts[int(target[len("group"):])]

    def port(self, target):
        return "port0" if target == "coord" else f"port{int(target[len('group'):]) + 1}"

    def run(self, *argv):
        subprocess.run(list(argv), check=True, stdout=subprocess.DEVNULL)

    def link(self, target, up):
        self.run("ip", "-n", self.switch, "link", "set", self.port(target), "up" if up else "down")

    def trickle(self, target, on):
        for ns, dev in ((self.ns(target), "eth0"), (self.switch, self.port(target))):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           stderr=subprocess.DEVNULL)
            if on:
                self.run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", "16kbit", "burst", "4kb", "latency", "2s")

    def kill_connections(self, target):
        self.run("ip", "netns", "exec", self.ns(target), "ss", "-K", "-t", "state", "established",
                 f"( sport = :{EXPERT_PORT} )")


def start_service(bed, ns, name, argv, timeout=60):
    """Starts a himoe service (argv, without --port_file) in namespace `ns`,
    its output in <work>/<name>.log; returns it once it serves."""
    pf = os.path.join(bed.work, f"{name}.port")
    if os.path.exists(pf):
        os.remove(pf)
    log = open(os.path.join(bed.work, f"{name}.log"), "a")
    p = subprocess.Popen(["ip", "netns", "exec", ns] + argv + [f"--port_file={pf}"],
                         stdout=log, stderr=log)
    deadline = time.time() + timeout
    while not (os.path.exists(pf) and os.path.getsize(pf) > 0):
        if p.poll() is not None or time.time() > deadline:
            sys.exit(f"chaos: {name} did not serve (exit {p.poll()}); see {bed.work}/{name}.log")
        time.sleep(0.02)
    return p


class Experts:
    """One himoe-expert a host, started again on its address after a fault."""

    def __init__(self, bed, build, flags):
        self.bed, self.flags = bed, flags
        self.bin = os.path.join(build, "expert_service", "himoe-expert")
        self.procs = {}
        self.run_state_dir = ""  # set: each keeps its run in <dir>/expert<g>.run

    def address(self, g):
        return f"{self.bed.host_ips[g]}:{EXPERT_PORT}"

    def start(self, g):
        run_state = [f"--run_state_file={self.run_state_dir}/expert{g}.run"] \
            if self.run_state_dir else []
        self.procs[g] = start_service(self.bed, self.bed.hosts[g], f"expert{g}", [
            self.bin, f"--address={self.address(g)}", f"--group_id={g}"] + self.flags + run_state)

    def stop_all(self):
        stop_processes(self.procs.values())


class Trainer:
    """himoe-trainer in the coordinator host, its stderr lines timestamped."""

    def __init__(self, bed, build, flags, out_dir):
        self.bed, self.flags, self.out_dir = bed, flags, out_dir
        self.bin = os.path.join(build, "trainer", "himoe-trainer")
        self.lines = []  # (time, line) of every attempt
        self.steps = []  # (time, step) of every progress line
        self.max_step = 0
        self.starts = []  # time of every start
        self.proc = None
        self.lock = threading.Lock()
        self.log = open(out_dir + ".log", "a")

    def has_checkpoint(self):
        d = os.path.join(self.out_dir, "checkpoints")
        return os.path.isdir(d) and any(
            os.path.exists(os.path.join(d, s, "MANIFEST")) for s in os.listdir(d))

    def start(self):
        argv = ["ip", "netns", "exec", self.bed.coord, self.bin] + self.flags + [
            "--out_dir", self.out_dir]
        if self.has_checkpoint():
            argv.append("--resume")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.starts.append(time.time())
        proc = self.proc

        def read():
            for line in proc.stderr:
                now = time.time()
                self.log.write(f"{now:.3f} {line}")
                line = line.rstrip("\n")
                step = None
                if line.startswith("step ") and "/" in line.split()[1]:
                    step = int(line.split()[1].split("/")[0])
                with self.lock:
                    self.lines.append((now, line))
                    if step is not None:
                        self.steps.append((now, step))
                        self.max_step = max(self.max_step, step)
            self.log.flush()

        t = threading.Thread(target=read, daemon=True)
        t.start()
        self.reader = t
        return self.proc

    def first_step_after(self, t):
        with self.lock:
            return next((ts for ts, _ in self.steps if ts >= t), None)

    def first_line_after(self, t, needle):
        with self.lock:
            return next((ts for ts, line in self.lines if ts >= t and needle in line), None)


class Injector:
    """Fires the faults on experts, links and connections, and the SIGSTOP of
    the process under test (`main`); puts each target back after its
    duration (tick() runs what is due)."""

    def __init__(self, bed, experts, t0):
        self.bed, self.experts, self.t0 = bed, experts, t0
        self.timers = []  # (time, action)
        self.busy = set()  # targets under a fault

    def later(self, delay, action):
        self.timers.append((time.time() + delay, action))

    def tick(self):
        now = time.time()
        for when, action in [t for t in self.timers if t[0] <= now]:
            self.timers.remove((when, action))
            action()

    def when_exited(self, p, action, give_up=None):
        """Runs `action` once `p` has exited (SIGKILL after 30 s), polling, so
        that the other faults' timers keep their times meanwhile."""
        give_up = give_up or time.time() + 30
        if p.poll() is None and time.time() < give_up:
            self.later(0.02, lambda: self.when_exited(p, action, give_up))
            return
        if p.poll() is None:
            p.kill()
            p.wait()
        action()

    def restored(self, f):
        f.restored = time.time()
        self.busy.discard(f.target)

    def log(self, f):
        print(f"chaos: {time.time() - self.t0:7.2f} s  fired {f.describe()}")
        sys.stdout.flush()

    def fire(self, f, main=None, restart=None):
        """Injects f. `main` is the process under test (trainer or router);
        after its SIGKILL or SIGTERM, restart(f) arranges its return."""
        f.fired = time.time()
        self.busy.add(f.target)
        kind, bed = f.kind, self.bed
        if kind in ("expert_kill", "expert_term", "expert_stop"):
            g = int(f.target[len("group"):])
            p = self.experts.procs[g]
            if kind == "expert_stop":
                p.send_signal(signal.SIGSTOP)
                self.later(f.duration, lambda: (p.send_signal(signal.SIGCONT), self.restored(f)))
            else:
                p.send_signal(signal.SIGKILL if kind == "expert_kill" else signal.SIGTERM)
                self.later(f.duration, lambda: self.when_exited(
                    p, lambda: (self.experts.start(g), self.restored(f))))
        elif kind in ("trainer_kill", "trainer_term", "router_kill", "router_term"):
            main.send_signal(signal.SIGKILL if kind.endswith("_kill") else signal.SIGTERM)
            restart(f)
        elif kind in ("trainer_stop", "router_stop"):
            main.send_signal(signal.SIGSTOP)
            self.later(f.duration, lambda: (main.send_signal(signal.SIGCONT), self.restored(f)))
        elif kind == "link_down":
            bed.link(f.target, up=False)
            self.later(f.duration, lambda: (bed.link(f.target, up=True), self.restored(f)))
        elif kind == "link_trickle":
            bed.trickle(f.target, on=True)
            self.later(f.duration, lambda: (bed.trickle(f.target, on=False), self.restored(f)))
        elif kind == "conn_kill":
            bed.kill_connections(f.target)
            self.restored(f)
        else:
            raise ValueError(kind)
        self.log(f)


def train_records(path):
    recs = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("kind") == "train":
                    recs.append(r)
    except OSError:
        pass
    return recs


def checkpoint_sums(out_dir, step):
    d = os.path.join(out_dir, "checkpoints", f"step_{step:08d}")
    sums = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            sums[name] = hashlib.sha256(f.read()).hexdigest()
    return sums


def chaos_model(bed):
    """The model of both chaos runs: 2 MoE layers, d_model 32, 2 experts a host."""
    return dict(layers=2, d=32, d_ff=64, experts=2 * len(bed.hosts))


def experts_and_cluster(bed, build, name, router=""):
    """One himoe-expert a host for chaos_model (not started yet), and a
    cluster file <work>/<name> naming them (with `router`, a router section)."""
    groups, model = len(bed.hosts), chaos_model(bed)
    experts = Experts(bed, build, [
        f"--num_groups={groups}", f"--num_experts={model['experts']}",
        f"--num_layers={model['layers']}", f"--d_model={model['d']}", f"--d_ff={model['d_ff']}",
        "--seed=1", "--threads=1", "--metrics_port=-1", "--insecure_training"])
    cluster = os.path.join(bed.work, name)
    with open(cluster, "w") as f:
        f.write(f"model {{ num_layers: {model['layers']} d_model: {model['d']} "
                f"d_ff: {model['d_ff']} num_experts: {model['experts']} top_k: 1 "
                f"num_groups: {groups} seed: 1 }}\nrouting {{ method: \"himoe\" }}\n")
        for g in range(groups):
            f.write(f"groups {{ address: \"{experts.address(g)}\" }}\n")
        f.write(router)
    return experts, cluster


def train(a, bed):
    groups = len(bed.hosts)
    model = chaos_model(bed)
    experts, cluster = experts_and_cluster(bed, a.build, "cluster.textproto")
    if a.run_state:
        experts.run_state_dir = bed.work
    flags = ["--experts=cluster", f"--cluster={cluster}", "--n_layer", str(model["layers"]),
             "--d_model", str(model["d"]), "--d_ff", str(model["d_ff"]), "--dense_ff", "64",
             "--n_head", "2", "--block_size", "32", "--batch_size", "4", "--grad_accum", "2",
             "--steps", str(a.steps), "--eval_every", str(max(1, a.steps // 3)),
             "--eval_windows", "4", "--checkpoint_every", str(a.checkpoint_every),
             "--keep_checkpoints", "3", "--log_every", "1", "--threads", "1",
             "--blas_probe=false", "--gemm_gflops=-1", "--metrics_port=-1",
             "--on_group_failure=wait_and_resume", f"--group_wait_s={a.group_wait_s}",
             "--max_group_restarts=100000", f"--group_keepalive_ms={a.keepalive_ms}",
             f"--retry_failed_step={'true' if a.retry_failed_step else 'false'}"]
    faults = make_schedule(a.seed, a.faults, a.steps, groups, TRAIN_KINDS)
    print(f"chaos train: seed {a.seed}, {len(faults)} faults over {a.steps} steps, "
          f"{groups} expert hosts; schedule (trigger step, fault, target, duration):")
    for f in faults:
        print("  " + f.describe())
    sys.stdout.flush()
    try:
        for g in range(groups):
            experts.start(g)
        ref_dir = os.path.join(bed.work, "reference")
        ref = Trainer(bed, a.build, flags, ref_dir)
        t0 = time.time()
        rc = ref.start().wait()
        ref.reader.join()
        ref_wall = time.time() - t0
        if rc != 0:
            sys.exit(f"chaos: the fault-free run failed (exit {rc}); see {ref_dir}.log")
        ref_steps = train_records(os.path.join(ref_dir, "metrics.jsonl"))
        step_s = sum(r["seconds"] for r in ref_steps) / len(ref_steps)
        first_step = ref.first_line_after(t0, "step 1/") or t0
        start_s = first_step - t0  # launch to the first step (set-up, resume, evaluation)
        print(f"chaos train: fault-free run {ref_wall:.1f} s ({step_s * 1000:.0f} ms a step, "
              f"{start_s:.1f} s from launch to step 1)")
        sys.stdout.flush()
        result = chaos_train(a, bed, experts, flags, faults)
    finally:
        experts.stop_all()
    return report_train(a, bed, faults, result, ref_dir, ref_wall, step_s, start_s)


def chaos_train(a, bed, experts, flags, faults):
    out = os.path.join(bed.work, "chaos")
    trainer = Trainer(bed, a.build, flags, out)
    exits = []         # (time, exit code, expected)
    expected_exit = [False]
    exited_at = [None]  # when the running trainer's exit was first seen
    pending = list(faults)
    # Then a fault that cannot heal: group 0 down for longer than
    # --group_wait_s. The trainer must end naming the group and its last good
    # checkpoint; the group is then started again and the trainer resumed.
    unhealable = dict(step=None, fired=None, checked=None, message="")
    if a.unhealable:
        unhealable["step"] = max([f.step for f in faults] + [0]) + 3
    t0 = time.time()
    proc = trainer.start()
    injector = Injector(bed, experts, t0)

    def rerun_later(f):
        expected_exit[0] = True
        f.pending_restart = True  # restored when the supervisor starts it again

    while True:
        injector.tick()
        while pending and trainer.max_step >= pending[0].step \
                and pending[0].target not in injector.busy \
                and proc.poll() is None:
            injector.fire(pending.pop(0), proc, rerun_later)
        if unhealable["step"] is not None and unhealable["fired"] is None and not pending \
                and not injector.busy and trainer.max_step >= unhealable["step"] \
                and proc.poll() is None:
            unhealable["fired"] = time.time()
            experts.procs[0].send_signal(signal.SIGKILL)
            print(f"chaos: {time.time() - t0:7.2f} s  fired unhealable expert_kill group0 "
                  f"(down until the trainer gives up)")
            sys.stdout.flush()
        rc = proc.poll()
        if rc is not None and exited_at[0] is None:
            exited_at[0] = time.time()
        if rc is not None and unhealable["fired"] and unhealable["checked"] is None:
            trainer.reader.join()
            unhealable["checked"] = time.time()
            text = "\n".join(l for t, l in trainer.lines if t >= unhealable["fired"])
            unhealable["rc"] = rc
            unhealable["message"] = next(
                (l for l in reversed(text.splitlines()) if "did not all serve again" in l), "")
            exits.append((exited_at[0], rc, True))
            exited_at[0] = None
            experts.procs[0].wait()
            experts.start(0)
            proc = trainer.start()
            continue
        # Restarted once the faults it overlapped are undone; its exit counts
        # from when it happened.
        if rc is not None and not injector.timers:
            trainer.reader.join()
            exits.append((exited_at[0], rc, expected_exit[0]))
            exited_at[0] = None
            if rc == 0:
                break
            if not expected_exit[0]:
                print(f"chaos: the trainer exited {rc} by itself")
                if sum(1 for _, c, e in exits if not e) > 3:
                    break
            expected_exit[0] = False
            proc = trainer.start()
            for f in faults:
                if getattr(f, "pending_restart", False):
                    f.pending_restart = False
                    f.restored = time.time()
                    injector.busy.discard(f.target)
        time.sleep(0.01)
    wall = time.time() - t0
    for f in faults:
        if f.fired is None:
            continue
        if f.target == "trainer" and f.kind != "trainer_stop":
            f.detected = next((t for t, _, e in exits if t >= f.fired), None)
        else:
            f.detected = trainer.first_line_after(f.fired, "expert group failure")
            # An error after the next fault is that one's, unless both fired together.
            nxt = next((g.fired for g in faults if g.fired and g.fired > f.fired + 0.5), None)
            if f.detected is not None and nxt is not None and f.detected > nxt:
                f.detected = None  # another fault's
        if f.restored is not None:
            f.recovered = trainer.first_step_after(f.restored)
    return dict(out=out, wall=wall, exits=exits, trainer=trainer, unhealable=unhealable)


def u_text(u):
    if u["step"] is None:
        return "not tried"
    if u["fired"] is None or u["checked"] is None:
        return "did not happen"
    return (f"exit {u.get('rc')} after {u['checked'] - u['fired']:.1f} s: "
            f"\"{u['message'].strip()}\"; resumed after the group came back")


def stat(v):
    """ "median / max" of seconds, or "-"."""
    if not v:
        return "-"
    v = sorted(v)
    return f"{v[len(v) // 2]:.2f} / {v[-1]:.2f}"


def finish(mode, a, md, problems):
    """Prints and writes (--out) the Markdown, then the problems; the exit code."""
    text = "\n".join(md) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    for p in problems:
        print(f"chaos {mode}: FAILED: " + p)
    if problems:
        print(f"chaos {mode}: replay with --seed {a.seed}")
    return 1 if problems else 0


def report_train(a, bed, faults, result, ref_dir, ref_wall, step_s, start_s):
    out = result["out"]
    problems = []
    unexpected = [rc for _, rc, e in result["exits"] if not e and rc != 0]
    final_rc = result["exits"][-1][1] if result["exits"] else None
    if final_rc != 0:
        problems.append(f"the chaos run did not end with exit 0 (last exit {final_rc})")
    if unexpected:
        problems.append(f"the trainer exited by itself with {unexpected} (not a fault's doing)")
    u = result["unhealable"]
    if u["step"] is not None:
        msg = u["message"]
        if u["fired"] is None:
            problems.append("the unhealable fault never fired")
        elif u.get("rc") != 1 or "expert group 0" not in msg or \
                "last good checkpoint is " + os.path.join(out, "checkpoints", "step_") not in msg:
            problems.append(f"group 0 down past --group_wait_s: exit {u.get('rc')}, "
                            f"not 1 with an error naming the group and the last good checkpoint "
                            f"(got: {msg or 'no such error'})")
    unfired = [f for f in faults if f.fired is None]
    if unfired:
        problems.append(f"{len(unfired)} faults never fired (the run ended first)")
    # Every step once, with the fault-free losses.
    ref = train_records(os.path.join(ref_dir, "metrics.jsonl"))
    got = train_records(os.path.join(out, "metrics.jsonl"))
    steps = [r["step"] for r in got]
    if steps != list(range(1, a.steps + 1)):
        dup = sorted({s for s in steps if steps.count(s) > 1})
        missing = sorted(set(range(1, a.steps + 1)) - set(steps))
        problems.append(f"the run log's steps are not 1..{a.steps} once each "
                        f"(repeated {dup[:10]}, missing {missing[:10]})")
    differ = [r["step"] for r, q in zip(got, ref)
              if {k: v for k, v in r.items() if k not in TIMING_FIELDS} !=
              {k: v for k, v in q.items() if k not in TIMING_FIELDS}]
    if differ:
        problems.append(f"{len(differ)} steps' losses or routing statistics differ from the "
                        f"fault-free run (first: step {differ[0]})")
    sums_ok = False
    try:
        want = checkpoint_sums(ref_dir, a.steps)
        have = checkpoint_sums(out, a.steps)
        bad = [n for n in want if have.get(n) != want[n]]
        sums_ok = not bad and set(want) == set(have)
        if not sums_ok:
            problems.append(f"final checkpoint differs from the fault-free run's: {bad}")
    except OSError as e:
        problems.append(f"no final checkpoint to compare: {e}")

    # Steps redone: each recovery's resume step against the newest step seen
    # before it.
    lines = result["trainer"].lines
    redone, last_step = 0, 0
    for _, line in lines:
        if line.startswith("step ") and "/" in line.split()[1]:
            last_step = max(last_step, int(line.split()[1].split("/")[0]))
        if line.startswith("resumed from"):
            at = int(line.rsplit(" ", 1)[1])
            redone += max(0, last_step - at)
            last_step = at
        elif line.startswith("step 0: val loss") and last_step > 0:
            redone += last_step  # recovered without a checkpoint: from step 0
            last_step = 0
    in_place = sum(1 for _, line in lines if line.startswith("every expert group kept its state"))
    # Group failures that reloaded a checkpoint: those the in-place retry
    # gave up on, or without it every one recovered (not the unhealable one).
    if a.retry_failed_step:
        group_reloads = sum(1 for _, line in lines if "; reloading the last checkpoint" in line)
    else:
        group_reloads = sum(1 for _, line in lines
                            if line.startswith("expert group failure at step")) - in_place - (
                                1 if result["unhealable"]["fired"] else 0)
    reloaded = sum(1 for _, line in lines if line.startswith("resumed from") or
                   line.startswith("step 0: val loss")) - 1  # less the first start
    down_s = sum((f.restored - f.fired) for f in faults if f.fired and f.restored)
    if u["fired"] is not None and u["checked"] is not None:
        down_s += u["checked"] - u["fired"]
    trainer_restarts = sum(1 for _, _, e in result["exits"] if e)
    # Expert starts after the first of each host, and those that restored a run.
    expert_restarts, expert_restored = 0, 0
    for g in range(len(bed.hosts)):
        with open(os.path.join(bed.work, f"expert{g}.log"), errors="replace") as f:
            text = f.read()
        expert_restarts += max(0, text.count("; serving on ") - 1)
        expert_restored += text.count("' restored at step ")
    theory = redone * step_s + down_s + trainer_restarts * start_s
    lost = result["wall"] - ref_wall
    fired = [f for f in faults if f.fired]
    detect = [f.detected - f.fired for f in fired if f.detected is not None]
    # A group or link fault is found by the trainer, so one that falls while the
    # trainer is stopped or restarting (its own fault) is found when it runs again.
    away = []
    for g in fired:
        if g.kind == "trainer_stop":
            away.append((g.fired, g.fired + g.duration))
        elif g.target == "trainer":
            away.append((g.fired, next((t for t in result["trainer"].starts if t > g.fired),
                                       float("inf"))))
    group_faults = [f for f in fired if f.target != "trainer" and f.detected is not None]
    beside = [f for f in group_faults if any(b <= f.detected and e >= f.fired for b, e in away)]
    alone = [f.detected - f.fired for f in group_faults if f not in beside]
    recover = [f.recovered - f.restored for f in fired
               if f.recovered is not None and f.restored is not None]

    cpu = cpu_model()
    md = [f"Training chaos, seed {a.seed}, measured {datetime.date.today()} on {cpu}, "
          f"{os.cpu_count()} cores, {platform.system()}: {len(bed.hosts)} expert hosts in network "
          f"namespaces, {a.steps} steps (2 MoE layers, d_model 32, {2 * len(bed.hosts)} experts), "
          f"checkpoint every {a.checkpoint_every} steps, keepalive {a.keepalive_ms} ms, "
          f"--retry_failed_step={'true' if a.retry_failed_step else 'false'}, expert "
          f"--run_state_file {'on' if a.run_state else 'off'}.", "",
          "| fault | step | target | s | detected after s | first step after restore s |",
          "|---|---|---|---|---|---|"]
    for f in faults:
        d = f"{f.detected - f.fired:.2f}" if f.fired and f.detected else "no error"
        r = f"{f.recovered - f.restored:.2f}" if f.recovered and f.restored else "-"
        md.append(f"| {f.kind} | {f.step} | {f.target} | {f.duration:.1f} | {d} | {r} |")
    md += ["", "| figure | value |", "|---|---|",
           f"| faults fired | {len(fired)} of {len(faults)} |",
           f"| trainer restarts (its own faults) | {trainer_restarts} |",
           f"| failed steps run again in place / checkpoint reloads (group recoveries and "
           f"trainer restarts) | {in_place} / {reloaded} |",
           f"| group recoveries by checkpoint reload (not a trainer restart) | "
           f"{group_reloads} |",
           f"| expert restarts / of them serving the run again from their run state file | "
           f"{expert_restarts} / {expert_restored} |",
           f"| exits not caused by a fault | {len(unexpected)} |",
           f"| group 0 down past --group_wait_s {a.group_wait_s} s | "
           f"{u_text(result['unhealable'])} |",
           f"| detection, median / max s | {stat(detect)} ({len(detect)} faults raised an error) |",
           f"| group and link faults while the trainer ran: found within 1 s / detection median / "
           f"max s | {sum(1 for d in alone if d <= 1.0)} of {len(alone)} / {stat(alone)} |",
           f"| group and link faults beside a trainer fault (found once it runs again): n, "
           f"detection max s | {len(beside)}, "
           f"{max(f.detected - f.fired for f in beside) if beside else 0:.2f} |",
           f"| restore to the first step, median / max s | {stat(recover)} |",
           f"| wall: fault-free / chaos s | {ref_wall:.1f} / {result['wall']:.1f} |",
           f"| time lost a fault s | {lost / max(1, len(fired)):.2f} |",
           f"| theoretical a fault s (redo {redone} steps x {step_s * 1000:.0f} ms + "
           f"{down_s:.1f} s down + {trainer_restarts} starts x {start_s:.1f} s) | "
           f"{theory / max(1, len(fired)):.2f} |",
           f"| lost / theoretical | {lost / theory if theory > 0 else float('nan'):.2f} |",
           f"| final checkpoint sha256 equal to the fault-free run's | "
           f"{'yes' if sums_ok else 'NO'} |",
           f"| run log: steps 1..{a.steps} once, losses equal | "
           f"{'yes' if not differ and steps == list(range(1, a.steps + 1)) else 'NO'} |"]
    return finish("train", a, md, problems)


SERVE_KINDS = ("expert_kill", "expert_term", "expert_stop", "router_kill", "router_term",
               "router_stop", "link_down", "link_trickle", "conn_kill")
ROUTER_PORT = 50051
# The statuses a router answers with when a group fails: each names the group.
SERVE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
PROMPTS = ("The expert ", "Fortune says")


class Router:
    """himoe-router in the coordinator host, on a fixed address, so that its
    clients find it again after a restart."""

    def __init__(self, bed, build, flags):
        self.bed, self.flags = bed, flags
        self.bin = os.path.join(build, "router_service", "himoe-router")
        self.address = f"{bed.coord_ip}:{ROUTER_PORT}"
        self.proc = None
        self.started = []  # (time serving, process)

    def start(self):
        self.proc = start_service(self.bed, self.bed.coord, "router",
                                  [self.bin] + self.flags + [f"--address={self.address}"])
        self.started.append((time.time(), self.proc))

    def stop(self):
        if self.proc is not None:
            stop_processes([self.proc])


def serve(a, bed):
    groups = len(bed.hosts)
    build = a.build
    model = chaos_model(bed)
    work = bed.work
    # The model served: a short in-process training run's checkpoint, and its
    # in-process answers (the load client's reference).
    run = os.path.join(work, "serve_model")
    subprocess.run([os.path.join(build, "trainer", "himoe-trainer"), "--experts=inprocess",
                    "--n_layer", str(model["layers"]), "--d_model", str(model["d"]),
                    "--d_ff", str(model["d_ff"]), "--dense_ff", "64", "--n_head", "2",
                    "--num_experts", str(model["experts"]), "--num_groups", str(groups),
                    "--block_size", "32", "--batch_size", "4", "--steps", "30",
                    "--eval_every", "30", "--eval_windows", "4", "--checkpoint_every", "30",
                    "--threads", "1", "--blas_probe=false", "--gemm_gflops=-1",
                    "--metrics_port=-1", "--out_dir", run],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = os.path.join(run, "checkpoints")
    refs = os.path.join(work, "reference")
    os.makedirs(refs, exist_ok=True)
    reference = os.path.join(build, "tests", "trainer", "himoe_serve_reference")
    if not os.path.exists(reference):
        sys.exit(f"chaos: {reference} is missing: build the tests (HIMOE_BUILD_TESTS=ON)")
    subprocess.run([reference,
                    f"--checkpoint={checkpoint}", f"--out_dir={refs}", "--forward_requests=8",
                    "--tokens=16", f"--prompts={','.join(PROMPTS)}",
                    f"--new_tokens={a.new_tokens}"], check=True)
    experts, cluster = experts_and_cluster(
        bed, build, "serve_cluster.textproto",
        f"router {{ deadline_ms: {a.deadline_ms} keepalive_ms: {a.keepalive_ms} }}\n")
    router = Router(bed, build, [f"--cluster={cluster}", f"--checkpoint={checkpoint}",
                                 "--reload_changed_experts", "--threads=1", "--metrics_port=-1",
                                 f"--max_new_tokens={a.new_tokens}"])
    count = a.faults if a.faults > 0 else max(1, int(a.seconds / a.interval) - 1)
    faults = make_schedule(a.seed, count, int(a.seconds), groups, SERVE_KINDS, spaced=True)
    for f in faults:
        f.unit = "s"
    print(f"chaos serve: seed {a.seed}, {len(faults)} faults over {a.seconds:g} s of load, "
          f"{groups} expert hosts, router deadline {a.deadline_ms} ms; schedule (second, fault, "
          f"target, duration):")
    for f in faults:
        print("  " + f.describe())
    sys.stdout.flush()
    results = os.path.join(work, "calls.jsonl")
    try:
        for g in range(groups):
            experts.start(g)
        router.start()
        result = chaos_serve(a, bed, experts, router, faults, refs, results)
    finally:
        router.stop()
        experts.stop_all()
    return report_serve(a, bed, faults, result, results)


def chaos_serve(a, bed, experts, router, faults, refs, results):
    start_file = os.path.join(bed.work, "load.started")
    load = subprocess.Popen(
        ["ip", "netns", "exec", bed.coord, "/usr/bin/python3",
         os.path.join(ROOT, "scripts", "chaos_load.py"), f"--router={router.address}",
         f"--refs={refs}", f"--gen={os.path.join(bed.work, 'gen')}", f"--out={results}",
         f"--seconds={a.seconds}", f"--timeout={a.client_timeout_s}",
         f"--start_file={start_file}"])
    while not os.path.exists(start_file):
        if load.poll() is not None:
            sys.exit(f"chaos: the load client exited with {load.returncode} before starting")
        time.sleep(0.02)
    t0 = time.time()
    injector = Injector(bed, experts, t0)
    pending = list(faults)
    expected_exit = [False]
    exits = []  # (time, exit code, expected)
    rss = []    # (time, name, pid, MiB)
    next_sample = t0

    def restart_router(f):
        exits.append((time.time(), router.proc.returncode, True))
        expected_exit[0] = False
        router.start()
        injector.restored(f)

    def restart_later(f):
        expected_exit[0] = True
        p = router.proc
        injector.later(f.duration, lambda: injector.when_exited(p, lambda: restart_router(f)))

    while load.poll() is None:
        injector.tick()
        now = time.time()
        while pending and now - t0 >= pending[0].step and pending[0].target not in injector.busy:
            injector.fire(pending.pop(0), router.proc, restart_later)
        if router.proc.poll() is not None and not expected_exit[0]:
            exits.append((time.time(), router.proc.returncode, False))
            print(f"chaos: the router exited {router.proc.returncode} by itself; started again")
            router.start()
        if now >= next_sample:
            next_sample = now + 2
            for name, p in [("router", router.proc)] + [
                    (f"expert {g}", p) for g, p in sorted(experts.procs.items())]:
                m = rss_mib(p.pid)
                if m is not None and p.poll() is None:
                    rss.append((now, name, p.pid, m))
        time.sleep(0.01)
    while injector.timers:  # put every target back
        injector.tick()
        time.sleep(0.01)
    return dict(t0=t0, wall=time.time() - t0, exits=exits, rss=rss, load_rc=load.returncode,
                router=router)


def report_serve(a, bed, faults, result, results):
    calls = []
    with open(results) as f:
        for line in f:
            try:
                calls.append(json.loads(line))
            except ValueError:
                pass
    problems = []
    if result["load_rc"] != 0:
        problems.append(f"the load client exited with {result['load_rc']}")
    unexpected = [rc for _, rc, e in result["exits"] if not e]
    if unexpected:
        problems.append(f"the router exited by itself with {unexpected}")
    fired = [f for f in faults if f.fired]
    if len(fired) < len(faults):
        problems.append(f"{len(faults) - len(fired)} faults never fired")
    # A call is judged against the faults active while it ran: on the router
    # or its host, the client's own errors are expected too.
    slack = 1.0

    def router_fault_during(c):
        return any(f.target in ("router", "coord") and f.fired <= c["t1"] and
                   (f.restored or float("inf")) + slack >= c["t0"] for f in fired)

    deadline_s = a.deadline_ms / 1000.0
    wrong, unclear, hangs = [], [], []
    for c in calls:
        c["s"] = c["t1"] - c["t0"]
        if c["verdict"] == "wrong":
            wrong.append(c)
            continue
        by_router = router_fault_during(c)
        if c["verdict"] == "error":
            named = c["code"] in SERVE_CODES and "expert group" in c["detail"]
            if not named and not (by_router and c["code"] in SERVE_CODES + ("CANCELLED",)):
                unclear.append(c)
        if by_router:
            continue
        if c["kind"] == "forward" and c["s"] > deadline_s + slack or \
                c["code"] == "DEADLINE_EXCEEDED" and c["s"] >= a.client_timeout_s - 0.05:
            hangs.append(c)
    if wrong:
        problems.append(f"{len(wrong)} wrong answers (first: {wrong[0]})")
    if unclear:
        problems.append(f"{len(unclear)} errors without a clear status naming the group "
                        f"(first: {unclear[0]})")
    if hangs:
        problems.append(f"{len(hangs)} calls past the deadline (first: {hangs[0]})")
    oks = sorted((c for c in calls if c["code"] == "OK"), key=lambda c: c["t0"])
    errors = sorted((c for c in calls if c["code"] != "OK"), key=lambda c: c["t1"])
    for i, f in enumerate(fired):
        nxt = next((g.fired for g in fired[i + 1:] if g.fired > f.fired + 0.5), float("inf"))
        f.detected = next((c["t1"] for c in errors if f.fired <= c["t1"] < nxt), None)
        # Of faults whose times overlap, recovery counts from the last return.
        end = f.restored or float("inf")
        f.overlapped = any(g is not f and g.fired <= end and (g.restored or float("inf")) >= f.fired
                           and (g.restored or float("inf"), g.index) > (end, f.index)
                           for g in fired)
        if f.restored is not None and not f.overlapped:
            f.recovered = next((c["t1"] for c in oks if c["t0"] >= f.restored), None)
    recover = [f.recovered - f.restored for f in fired if f.recovered is not None]
    late = [f for f in fired if f.restored is not None and not f.overlapped and
            (f.recovered is None or f.recovered - f.restored > a.resume_s)]
    if late:
        problems.append(f"{len(late)} faults after which serving did not resume within "
                        f"{a.resume_s:g} s: " + ", ".join(f"#{f.index:02d} {f.kind}" for f in late))
    # Memory: each process's RSS ~10 s after it started serving against its
    # last, for the longest-lived router and expert process of each group.
    pids = {}
    for t, name, pid, m in result["rss"]:
        pids.setdefault((name, pid), []).append((t, m))
    longest = {}
    for (name, pid), series in pids.items():
        if name not in longest or series[-1][0] - series[0][0] > \
                longest[name][-1][0] - longest[name][0][0]:
            longest[name] = series
    memory = []
    for name, series in sorted(longest.items()):
        if len(series) < 10:
            continue  # under 20 s
        start, end = series[5][1], series[-1][1]
        memory.append((name, series[-1][0] - series[0][0], start, end,
                       max(m for _, m in series)))
        if end > start * 1.1 + 8:
            problems.append(f"{name}'s memory grew from {start:.0f} to {end:.0f} MiB")

    codes = {}
    for c in calls:
        codes.setdefault((c["kind"], c["code"]), 0)
        codes[(c["kind"], c["code"])] += 1
    lat = sorted(c["s"] for c in calls if c["code"] == "OK" and c["kind"] == "forward")
    checked = {k: sum(1 for c in calls if c["kind"] == k and c["verdict"] == "ok")
               for k in ("forward", "generate")}
    if not checked["forward"] or not checked["generate"]:
        problems.append(f"too few answers checked: {checked}")
    cpu = cpu_model()
    md = [f"Serving chaos, seed {a.seed}, measured {datetime.date.today()} on {cpu}, "
          f"{os.cpu_count()} cores, {platform.system()}: {len(bed.hosts)} expert hosts in network "
          f"namespaces, the router on the coordinator host (deadline {a.deadline_ms} ms, "
          f"keepalive {a.keepalive_ms} ms, --reload_changed_experts) serving a checkpoint "
          f"(2 MoE layers, d_model 32, {2 * len(bed.hosts)} experts); 2 RouteForward and 2 "
          f"Generate clients "
          f"({a.new_tokens} tokens a stream) for {a.seconds:g} s, a fault every "
          f"{a.seconds / (len(faults) + 1):.0f} s; each answer checked against the in-process "
          f"reference (RouteForward within 1e-5, Generate token for token).", "",
          "| fault | s | target | lasts s | first error after s | first good answer after "
          "the return s |", "|---|---|---|---|---|---|"]
    for f in faults:
        d = f"{f.detected - f.fired:.2f}" if f.fired and f.detected else "no error"
        r = f"{f.recovered - f.restored:.2f}" if f.recovered and f.restored else \
            "(overlapped: from the later return)" if getattr(f, "overlapped", False) else "-"
        md.append(f"| {f.kind} | {f.step} | {f.target} | {f.duration:.1f} | {d} | {r} |")
    md += ["", "| calls | " + " | ".join(f"{k} {c}" for k, c in sorted(codes)) + " |",
           "|---|" + "---|" * len(codes),
           f"| {len(calls)} | " + " | ".join(str(codes[k]) for k in sorted(codes)) + " |", "",
           "| figure | value |", "|---|---|",
           f"| faults fired | {len(fired)} of {len(faults)} |",
           f"| answers equal to the reference: RouteForward / Generate | {checked['forward']} / "
           f"{checked['generate']} |",
           f"| wrong answers | {len(wrong)} |",
           f"| errors without a clear status | {len(unclear)} |",
           f"| calls past the deadline | {len(hangs)} |",
           f"| router exits not caused by a fault | {len(unexpected)} |",
           "| RouteForward OK latency p50 / p99 / max ms | "
           + (f"{1000 * lat[len(lat) // 2]:.1f} / {1000 * lat[int(0.99 * (len(lat) - 1))]:.1f} / "
              f"{1000 * lat[-1]:.1f} |" if lat else "- |"),
           f"| first error after the fault, median / max s | "
           f"{stat([f.detected - f.fired for f in fired if f.detected])} |",
           f"| first good answer after the return, median / max s | {stat(recover)} |"]
    for name, lived, start, end, peak in memory:
        md.append(f"| RSS {name} (longest-lived process, {lived:.0f} s): after 10 s / end / "
                  f"peak MiB | {start:.0f} / {end:.0f} / {peak:.0f} |")
    return finish("serve", a, md, problems)



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["train", "serve"])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--work", required=True)
    ap.add_argument("--switch", required=True)
    ap.add_argument("--coord", required=True)
    ap.add_argument("--coord_ip", required=True)
    ap.add_argument("--hosts", required=True)
    ap.add_argument("--host_ips", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", type=int, default=-1,
                    help="train: default 32; serve: default one every --interval s")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=600, help="serve: seconds of load")
    ap.add_argument("--interval", type=float, default=20, help="serve: seconds between faults")
    ap.add_argument("--deadline_ms", type=int, default=2000, help="serve: router.deadline_ms")
    ap.add_argument("--client_timeout_s", type=float, default=10,
                    help="serve: the load client's deadline of a call")
    ap.add_argument("--resume_s", type=float, default=2,
                    help="serve: serving must resume this soon after a target returns")
    ap.add_argument("--new_tokens", type=int, default=16, help="serve: tokens a Generate stream")
    ap.add_argument("--checkpoint_every", type=int, default=10)
    ap.add_argument("--keepalive_ms", type=int, default=250)
    ap.add_argument("--group_wait_s", type=int, default=10)
    ap.add_argument("--retry_failed_step", type=int, default=1,
                    help="train: 1 runs a failed step again where every group kept its state; "
                         "0 always reloads the last checkpoint")
    ap.add_argument("--run_state", type=int, default=1,
                    help="train: 1 gives each expert a --run_state_file, so a restarted group "
                         "serves the run again; 0: a restarted group costs a checkpoint reload")
    ap.add_argument("--unhealable", type=int, default=1,
                    help="1: end with a group down past --group_wait_s")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    bed = Testbed(a)
    if a.mode == "serve":
        return serve(a, bed)
    if a.faults < 0:
        a.faults = 32
    return train(a, bed)


if __name__ == "__main__":
    sys.exit(main())
