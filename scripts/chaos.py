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

The schedule is (trigger step, target, fault, duration) from --seed: the same
seed replays the same faults. A fault fires once the run has reached its
trigger step; faults that share a trigger step overlap. Faults:

  expert_kill, expert_term   SIGKILL / SIGTERM an expert process; it is started
                             again on its address after the duration
  expert_stop                SIGSTOP an expert process, SIGCONT after it
  trainer_kill, trainer_term SIGKILL / SIGTERM the trainer; it is started again
                             with --resume (as a Job controller would)
  trainer_stop               SIGSTOP the trainer, SIGCONT after it
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
        self.fired = None      # time injected
        self.restored = None   # time the target was back (started, continued, link up)
        self.detected = None   # time of the first clear error after it
        self.recovered = None  # time of the first step after it was restored

    def describe(self):
        return (f"#{self.index:02d} step {self.step:4d}  {self.kind:<13} {self.target:<8} "
                f"{self.duration:.1f} s")


def make_schedule(seed, count, steps, groups, kinds):
    """count faults over steps [5, steps - 5], every kind at least once when
    count allows; about one in four shares the previous fault's step
    (overlapping) on another target."""
    rng = random.Random(seed)
    chosen = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(chosen)
    triggers = sorted(rng.randint(5, max(6, steps - 5)) for _ in range(count))
    faults = []
    for i, kind in enumerate(chosen):
        if kind.startswith("trainer"):
            target = "trainer"
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


class Experts:
    """One himoe-expert a host, started again on its address after a fault."""

    def __init__(self, bed, build, flags):
        self.bed, self.flags = bed, flags
        self.bin = os.path.join(build, "expert_service", "himoe-expert")
        self.procs = {}

    def address(self, g):
        return f"{self.bed.host_ips[g]}:{EXPERT_PORT}"

    def start(self, g, timeout=60):
        pf = os.path.join(self.bed.work, f"expert{g}.port")
        if os.path.exists(pf):
            os.remove(pf)
        log = open(os.path.join(self.bed.work, f"expert{g}.log"), "a")
        p = subprocess.Popen(["ip", "netns", "exec", self.bed.hosts[g], self.bin,
                              f"--address={self.address(g)}", f"--group_id={g}",
                              f"--port_file={pf}"] + self.flags, stdout=log, stderr=log)
        self.procs[g] = p
        deadline = time.time() + timeout
        while not (os.path.exists(pf) and os.path.getsize(pf) > 0):
            if p.poll() is not None or time.time() > deadline:
                sys.exit(f"chaos: expert {g} did not serve (exit {p.poll()}); "
                         f"see {self.bed.work}/expert{g}.log")
            time.sleep(0.02)

    def stop_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Trainer:
    """himoe-trainer in the coordinator host, its stderr lines timestamped."""

    def __init__(self, bed, build, flags, out_dir):
        self.bed, self.flags, self.out_dir = bed, flags, out_dir
        self.bin = os.path.join(build, "trainer", "himoe-trainer")
        self.lines = []  # (time, line) of every attempt
        self.steps = []  # (time, step) of every progress line
        self.max_step = 0
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


def train(a, bed):
    groups = len(bed.hosts)
    model = dict(layers=2, d=32, d_ff=64, experts=2 * groups)
    expert_flags = [f"--num_groups={groups}", f"--num_experts={model['experts']}",
                    f"--num_layers={model['layers']}", f"--d_model={model['d']}",
                    f"--d_ff={model['d_ff']}", "--seed=1", "--threads=1", "--metrics_port=-1",
                    "--insecure_training"]
    experts = Experts(bed, a.build, expert_flags)
    cluster = os.path.join(bed.work, "cluster.textproto")
    with open(cluster, "w") as f:
        f.write(f"model {{ num_layers: {model['layers']} d_model: {model['d']} "
                f"d_ff: {model['d_ff']} num_experts: {model['experts']} top_k: 1 "
                f"num_groups: {groups} seed: 1 }}\nrouting {{ method: \"himoe\" }}\n")
        for g in range(groups):
            f.write(f"groups {{ address: \"{experts.address(g)}\" }}\n")
    flags = ["--experts=cluster", f"--cluster={cluster}", "--n_layer", str(model["layers"]),
             "--d_model", str(model["d"]), "--d_ff", str(model["d_ff"]), "--dense_ff", "64",
             "--n_head", "2", "--block_size", "32", "--batch_size", "4", "--grad_accum", "2",
             "--steps", str(a.steps), "--eval_every", str(max(1, a.steps // 3)),
             "--eval_windows", "4", "--checkpoint_every", str(a.checkpoint_every),
             "--keep_checkpoints", "3", "--log_every", "1", "--threads", "1",
             "--blas_probe=false", "--gemm_gflops=-1", "--metrics_port=-1",
             "--on_group_failure=wait_and_resume", f"--group_wait_s={a.group_wait_s}",
             "--max_group_restarts=100000", f"--group_keepalive_ms={a.keepalive_ms}"]
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
    timers = []        # (time, action)
    busy = set()       # targets under a fault
    exits = []         # (time, exit code, expected)
    expected_exit = [False]
    pending = list(faults)
    # Then a fault that cannot heal: group 0 down for longer than
    # --group_wait_s. The trainer must end naming the group and its last good
    # checkpoint; the group is then started again and the trainer resumed.
    unhealable = dict(step=None, fired=None, checked=None, message="")
    if a.unhealable:
        unhealable["step"] = max([f.step for f in faults] + [0]) + 3
    t0 = time.time()
    proc = trainer.start()

    def later(delay, action):
        timers.append((time.time() + delay, action))

    def fire(f):
        f.fired = time.time()
        busy.add(f.target)
        kind = f.kind

        def restored():
            f.restored = time.time()
            busy.discard(f.target)

        if kind in ("expert_kill", "expert_term", "expert_stop"):
            g = int(f.target[len("group"):])
            p = experts.procs[g]
            if kind == "expert_stop":
                p.send_signal(signal.SIGSTOP)
                later(f.duration, lambda: (p.send_signal(signal.SIGCONT), restored()))
            else:
                p.send_signal(signal.SIGKILL if kind == "expert_kill" else signal.SIGTERM)

                def back():
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                    experts.start(g)
                    restored()
                later(f.duration, back)
        elif kind in ("trainer_kill", "trainer_term"):
            expected_exit[0] = True
            proc.send_signal(signal.SIGKILL if kind == "trainer_kill" else signal.SIGTERM)
            f.pending_restart = True  # restored when the supervisor starts it again
        elif kind == "trainer_stop":
            proc.send_signal(signal.SIGSTOP)
            later(f.duration, lambda: (proc.send_signal(signal.SIGCONT), restored()))
        elif kind == "link_down":
            bed.link(f.target, up=False)
            later(f.duration, lambda: (bed.link(f.target, up=True), restored()))
        elif kind == "link_trickle":
            bed.trickle(f.target, on=True)
            later(f.duration, lambda: (bed.trickle(f.target, on=False), restored()))
        elif kind == "conn_kill":
            bed.kill_connections(f.target)
            restored()
        print(f"chaos: {time.time() - t0:7.2f} s  fired {f.describe()}")
        sys.stdout.flush()

    while True:
        now = time.time()
        for when, action in [t for t in timers if t[0] <= now]:
            timers.remove((when, action))
            action()
        while pending and trainer.max_step >= pending[0].step and pending[0].target not in busy \
                and proc.poll() is None:
            fire(pending.pop(0))
        if unhealable["step"] is not None and unhealable["fired"] is None and not pending \
                and not busy and trainer.max_step >= unhealable["step"] and proc.poll() is None:
            unhealable["fired"] = time.time()
            experts.procs[0].send_signal(signal.SIGKILL)
            print(f"chaos: {time.time() - t0:7.2f} s  fired unhealable expert_kill group0 "
                  f"(down until the trainer gives up)")
            sys.stdout.flush()
        rc = proc.poll()
        if rc is not None and unhealable["fired"] and unhealable["checked"] is None:
            trainer.reader.join()
            unhealable["checked"] = time.time()
            text = "\n".join(l for t, l in trainer.lines if t >= unhealable["fired"])
            unhealable["rc"] = rc
            unhealable["message"] = next(
                (l for l in reversed(text.splitlines()) if "did not all serve again" in l), "")
            exits.append((time.time(), rc, True))
            experts.procs[0].wait()
            experts.start(0)
            proc = trainer.start()
            continue
        if rc is not None and not any(t for t in timers):
            trainer.reader.join()
            exits.append((time.time(), rc, expected_exit[0]))
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
                    busy.discard(f.target)
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
    down_s = sum((f.restored - f.fired) for f in faults if f.fired and f.restored)
    if u["fired"] is not None and u["checked"] is not None:
        down_s += u["checked"] - u["fired"]
    trainer_restarts = sum(1 for _, _, e in result["exits"] if e)
    theory = redone * step_s + down_s + trainer_restarts * start_s
    lost = result["wall"] - ref_wall
    fired = [f for f in faults if f.fired]
    detect = [f.detected - f.fired for f in fired if f.detected is not None]
    recover = [f.recovered - f.restored for f in fired
               if f.recovered is not None and f.restored is not None]

    def stat(v):
        if not v:
            return "-"
        v = sorted(v)
        return f"{v[len(v) // 2]:.2f} / {v[-1]:.2f}"

    cpu = "unknown"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    md = [f"Training chaos, seed {a.seed}, measured {datetime.date.today()} on {cpu}, "
          f"{os.cpu_count()} cores, {platform.system()}: {len(bed.hosts)} expert hosts in network "
          f"namespaces, {a.steps} steps (2 MoE layers, d_model 32, {2 * len(bed.hosts)} experts), "
          f"checkpoint every {a.checkpoint_every} steps, keepalive {a.keepalive_ms} ms.", "",
          "| fault | step | target | s | detected after s | first step after restore s |",
          "|---|---|---|---|---|---|"]
    for f in faults:
        d = f"{f.detected - f.fired:.2f}" if f.fired and f.detected else "no error"
        r = f"{f.recovered - f.restored:.2f}" if f.recovered and f.restored else "-"
        md.append(f"| {f.kind} | {f.step} | {f.target} | {f.duration:.1f} | {d} | {r} |")
    md += ["", "| figure | value |", "|---|---|",
           f"| faults fired | {len(fired)} of {len(faults)} |",
           f"| trainer restarts (its own faults) | {trainer_restarts} |",
           f"| exits not caused by a fault | {len(unexpected)} |",
           f"| group 0 down past --group_wait_s {a.group_wait_s} s | "
           f"{u_text(result['unhealable'])} |",
           f"| detection, median / max s | {stat(detect)} ({len(detect)} faults raised an error) |",
           f"| restore to the first step, median / max s | {stat(recover)} |",
           f"| wall: fault-free / chaos s | {ref_wall:.1f} / {result['wall']:.1f} |",
           f"| time lost a fault s | {lost / max(1, len(fired)):.2f} |",
           f"| theoretical a fault s (redo {redone} steps x {step_s * 1000:.0f} ms + {down_s:.1f} s "
           f"down + {trainer_restarts} starts x {start_s:.1f} s) | "
           f"{theory / max(1, len(fired)):.2f} |",
           f"| lost / theoretical | {lost / theory if theory > 0 else float('nan'):.2f} |",
           f"| final checkpoint sha256 equal to the fault-free run's | "
           f"{'yes' if sums_ok else 'NO'} |",
           f"| run log: steps 1..{a.steps} once, losses equal | "
           f"{'yes' if not differ and steps == list(range(1, a.steps + 1)) else 'NO'} |"]
    text = "\n".join(md) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    for p in problems:
        print("chaos train: FAILED: " + p)
    if problems:
        print(f"chaos train: logs in {bed.work} (replay with --seed {a.seed})")
    return 1 if problems else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["train"])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--work", required=True)
    ap.add_argument("--switch", required=True)
    ap.add_argument("--coord", required=True)
    ap.add_argument("--coord_ip", required=True)
    ap.add_argument("--hosts", required=True)
    ap.add_argument("--host_ips", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--checkpoint_every", type=int, default=10)
    ap.add_argument("--keepalive_ms", type=int, default=250)
    ap.add_argument("--group_wait_s", type=int, default=10)
    ap.add_argument("--unhealable", type=int, default=1,
                    help="1: end with a group down past --group_wait_s")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    bed = Testbed(a)
    return train(a, bed)


if __name__ == "__main__":
    sys.exit(main())
