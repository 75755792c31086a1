#!/usr/bin/python3
"""himoe-plot end to end: three tiny in-process runs (himoe, vanilla,
loss_free), the per-run images and the PPL-CV scatter; the numbers handed to
gnuplot are checked against metrics.jsonl and the trainer's own balance
table; balance.png's data against the run's diagnostics and against made-up
ones (with and without a controller bias), and skipped for a JSONL of an
older trainer; bad inputs fail with the file named.

  plot_test.py HIMOE_TRAINER SOURCE_ROOT
"""

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

TRAINER, ROOT = sys.argv[1], sys.argv[2]
PLOT = os.path.join(ROOT, "trainer", "plot", "himoe-plot")
STEPS, EVAL_EVERY, LAYERS, EXPERTS, GROUPS = 24, 12, 2, 8, 4
TINY = ["--experts=inprocess", f"--steps={STEPS}", f"--eval_every={EVAL_EVERY}",
        "--eval_windows=4", f"--n_layer={LAYERS}", "--n_head=2", "--d_model=32", "--d_ff=32",
        "--dense_ff=64", "--block_size=16", "--batch_size=4", "--threads=1",
        f"--num_experts={EXPERTS}", f"--num_groups={GROUPS}"]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)
    return cond


def plot(*args):
    return subprocess.run([sys.executable, PLOT, *args], capture_output=True, text=True)


def read_jsonl(path):
    with open(path) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    return [r for r in recs if r["kind"] == "train"], [r for r in recs if r["kind"] == "eval"]


def number(x):
    try:
        return float(x)
    except ValueError:
        return x


def read_table(path):
    """Header line, then rows; blank lines split blocks."""
    with open(path) as f:
        header = f.readline().split()
        blocks, cur = [], []
        for line in f:
            if line.strip():
                cur.append([number(x) for x in line.split()])
            elif cur:
                blocks.append(cur)
                cur = []
        if cur:
            blocks.append(cur)
    return header, blocks


def close(a, b, tol=2e-5):
    return abs(a - b) <= tol * max(1.0, abs(b))


def check_png(path, width, min_height=300, min_bytes=8000):
    if not check(os.path.isfile(path), f"{path} exists"):
        return
    with open(path, "rb") as f:
        head = f.read(24)
    check(head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is a PNG")
    w, h = struct.unpack(">II", head[16:24])
    check(w == width and h >= min_height, f"{path} is {width} wide and >= {min_height} high "
          f"(got {w}x{h})")
    size = os.path.getsize(path)
    check(min_bytes <= size <= 400_000, f"{path} size {size} in [{min_bytes}, 400000]")


def cv(load):
    mean = sum(load) / len(load)
    return math.sqrt(sum((c - mean) ** 2 for c in load) / len(load)) / mean


BALANCE_KEYS = ("top_share", "load_entropy", "mean_pi_sq")


def check_balance_data(data, train, evals, what):
    """balance.dat: per step, per key and layer, the JSONL's value;
    balance_eval.dat the same for the eval lines with layers;
    balance_bias.dat: the last step's balance_bias when any is non-zero."""
    cols = ["step"] + [f"{k}_l{l}" for k in BALANCE_KEYS for l in range(LAYERS)]

    def same(row, rec):
        return row[0] == rec["step"] and all(
            close(row[cols.index(f"{k}_l{l}")], rec["layers"][l][k])
            for k in BALANCE_KEYS for l in range(LAYERS))

    header, blocks = read_table(os.path.join(data, "balance.dat"))
    rows = blocks[0] if blocks else []
    check(header == cols and len(rows) == len(train) and
          all(same(row, rec) for row, rec in zip(rows, train)),
          f"{what}: balance.dat = top_share, load_entropy, mean_pi_sq per step and layer")
    with_layers = [e for e in evals if "layers" in e]
    header, blocks = read_table(os.path.join(data, "balance_eval.dat"))
    rows = blocks[0] if blocks else []
    check(header == cols and len(rows) == len(with_layers) and
          all(same(row, rec) for row, rec in zip(rows, with_layers)),
          f"{what}: balance_eval.dat = the eval lines' per-layer diagnostics")
    bias_file = os.path.join(data, "balance_bias.dat")
    nonzero = any(v != 0 for rec in train for l in rec["layers"]
                  for v in l.get("balance_bias", []))
    if not check(os.path.exists(bias_file) == nonzero,
                 f"{what}: balance_bias.dat exists iff a bias is non-zero ({nonzero})"):
        return
    if nonzero:
        header, blocks = read_table(bias_file)
        final = train[-1]["layers"]
        check(header == ["expert", "group"] + [f"bias_l{l}" for l in range(LAYERS)] and
              len(blocks[0]) == EXPERTS and
              all(row[0] == e and row[1] == e // (EXPERTS // GROUPS) and
                  all(close(row[2 + l], final[l]["balance_bias"][e]) for l in range(LAYERS))
                  for e, row in enumerate(blocks[0])),
              f"{what}: balance_bias.dat = the last step's bias per expert and layer")


def rewrite_jsonl(src, dst, edit):
    """Copies a metrics.jsonl, passing every train/eval record through edit."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(src) as f, open(dst, "w") as g:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") in ("train", "eval"):
                edit(rec)
            g.write(json.dumps(rec) + "\n")


tmp = tempfile.mkdtemp(prefix="himoe-plot-test-")
runs, reported_cv = {}, {}
for method in ("himoe", "vanilla", "loss_free"):
    # Not named after the method: the scatter labels must come from the config line.
    out = os.path.join(tmp, f"run_{method}")
    r = subprocess.run([TRAINER, *TINY, f"--method={method}", f"--out_dir={out}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"trainer --method={method} failed:\n{r.stderr}")
    runs[method] = out
    # The trainer's final table: "layer  expert CV  group CV  MaxVio  groups/token ..."
    # then the balance diagnostics, which this check does not read.
    table = re.findall(r"^(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(?:\s.*)?$",
                       r.stderr, re.M)
    check(len(table) == LAYERS, f"{method}: trainer balance table has {LAYERS} layers")
    reported_cv[method] = sum(float(t[1]) for t in table) / max(1, len(table))
    # The config line opens the JSONL: the run's settings as a RunConfig.
    with open(os.path.join(out, "metrics.jsonl")) as f:
        config = json.loads(f.readline())
    check(config.get("kind") == "config" and
          config.get("model", {}).get("routing", {}).get("method") == method and
          config["model"].get("n_layer") == LAYERS and
          config["model"]["routing"].get("num_experts") == EXPERTS and
          config.get("training", {}).get("experts") == "inprocess",
          f"{method}: config line {config}")

# --- One run: images and the data behind them. ---------------------------------------
run = runs["himoe"]
out = os.path.join(tmp, "plots")
r = plot(run, "--out", out)
check(r.returncode == 0, f"himoe-plot {run}: rc {r.returncode}\n{r.stderr}")
check_png(os.path.join(out, "heatmap.png"), 900)
for l in range(LAYERS):
    check_png(os.path.join(out, f"heatmap_layer{l}.png"), 700)
check_png(os.path.join(out, "group_share.png"), 900)
check_png(os.path.join(out, "loss.png"), 900)
train, evals = read_jsonl(os.path.join(run, "metrics.jsonl"))
# The trainer writes the per-layer diagnostics balance.png needs (top_share,
# load_entropy, mean_pi_sq, balance_bias) on every train line: missing ones
# are a failure, not another path.
missing = [(rec["step"], l, k) for rec in train for l, layer in enumerate(rec["layers"])
           for k in BALANCE_KEYS if k not in layer]
check(not missing, f"the trainer's train lines carry every balance diagnostic: missing {missing[:5]}")
printed = r.stdout.split()
check(len(printed) == 3 + LAYERS + 1, f"himoe-plot prints the {3 + LAYERS + 1} images: {printed}")
check_png(os.path.join(out, "balance.png"), 900, min_height=700)
check_balance_data(os.path.join(out, "data"), train, evals, "himoe run")
check(len(train) == STEPS and len(evals) == STEPS // EVAL_EVERY + 1, "the run's JSONL")
data = os.path.join(out, "data")
for l in range(LAYERS):
    header, blocks = read_table(os.path.join(data, f"heatmap_layer{l}.dat"))
    check(header == ["step", "expert", "share"], f"heatmap_layer{l}.dat header {header}")
    check(len(blocks) == STEPS and all(len(b) == EXPERTS for b in blocks),
          f"heatmap_layer{l}.dat: {STEPS} scan lines of {EXPERTS} experts")
    for rec, block in zip(train, blocks):
        counts = rec["layers"][l]["expert_counts"]
        ok = all(row[0] == rec["step"] and row[1] == e and close(row[2], counts[e] / sum(counts))
                 for e, row in enumerate(block))
        check(ok, f"heatmap_layer{l}.dat step {rec['step']}: expert counts / their sum")
        check(close(sum(row[2] for row in block), 1.0, 1e-4), f"layer {l} step {rec['step']} "
              "expert shares sum to 1")
    header, blocks = read_table(os.path.join(data, f"group_share_layer{l}.dat"))
    rows = blocks[0]
    check(header == ["step"] + [f"g{g}" for g in range(GROUPS)] +
          [f"soft_g{g}" for g in range(GROUPS)] and len(blocks) == 1 and len(rows) == STEPS,
          f"group_share_layer{l}.dat: {STEPS} rows of step + {GROUPS} hard + {GROUPS} soft")
    for rec, row in zip(train, rows):
        hard, soft = rec["layers"][l]["group_counts"], rec["layers"][l]["soft_group_load"]
        check(row[0] == rec["step"] and
              all(close(row[1 + g], hard[g] / sum(hard)) for g in range(GROUPS)) and
              all(close(row[1 + GROUPS + g], soft[g] / sum(soft)) for g in range(GROUPS)) and
              close(sum(row[1:1 + GROUPS]), 1.0, 1e-4) and close(sum(row[1 + GROUPS:]), 1.0, 1e-4),
              f"group_share_layer{l}.dat step {rec['step']}: group counts (and soft load) / sum")
header, blocks = read_table(os.path.join(data, "loss.dat"))
check(len(blocks) == 1 and len(blocks[0]) == STEPS, f"loss.dat has {STEPS} rows")
for rec, row in zip(train, blocks[0]):
    check(all(close(row[header.index(c)], rec[c]) for c in ("loss", "task", "load", "intra", "balance")),
          f"loss.dat step {rec['step']} matches the JSONL")
header, blocks = read_table(os.path.join(data, "eval.dat"))
check([(row[0], row[2]) for row in blocks[0]] == [(e["step"], e["val_ppl"]) for e in evals],
      "eval.dat: step and val_ppl of every evaluation")

# Heatmap rows of 5 steps: counts summed per bin (the last one holds 4 steps).
r = plot(run, "--out", os.path.join(tmp, "binned"), "--bin", "5")
check(r.returncode == 0, f"--bin 5: rc {r.returncode}\n{r.stderr}")
header, blocks = read_table(os.path.join(tmp, "binned", "data", "heatmap_layer1.dat"))
check(len(blocks) == math.ceil(STEPS / 5) and all(len(b) == EXPERTS for b in blocks),
      f"--bin 5: {math.ceil(STEPS / 5)} scan lines")
for b, block in enumerate(blocks):
    in_bin = train[5 * b:5 * b + 5]
    counts = [sum(s["layers"][1]["expert_counts"][e] for s in in_bin) for e in range(EXPERTS)]
    check(all(row[0] == 1 + 5 * b + 2 and close(row[2], counts[e] / sum(counts))
              for e, row in enumerate(block)), f"--bin 5: bin {b} = summed counts / their sum")

r = plot(run, "--out", os.path.join(tmp, "svg"), "--format", "svg")
check(r.returncode == 0, f"--format svg: rc {r.returncode}\n{r.stderr}")
with open(os.path.join(tmp, "svg", "loss.svg")) as f:
    check("<svg" in f.read(4000), "loss.svg is an SVG")

# --- balance.png from hand-made diagnostics (independent of the trainer's). ---------
def made_up(rec):
    """Diagnostics that differ per step, layer and key; a bias from step 10 on;
    eval lines get layers too."""
    t = rec["step"]
    if rec["kind"] == "eval":
        rec["layers"] = [{"expert_cv": 0.1 * l} for l in range(LAYERS)]
    for l, layer in enumerate(rec["layers"]):
        layer["top_share"] = 0.5 + 0.01 * t + 0.1 * l
        layer["load_entropy"] = 1.0 - 0.005 * t - 0.05 * l
        layer["mean_pi_sq"] = 0.125 + 0.001 * t * (l + 1)
        if rec["kind"] == "train":
            layer["balance_bias"] = [0.0 if t < 10 else 0.01 * (e - 3.5) * (l + 1) * t
                                     for e in range(EXPERTS)]


made = os.path.join(tmp, "made_up", "metrics.jsonl")
rewrite_jsonl(os.path.join(run, "metrics.jsonl"), made, made_up)
r = plot(os.path.dirname(made), "--out", os.path.join(tmp, "made_up_plots"))
check(r.returncode == 0, f"made-up diagnostics: rc {r.returncode}\n{r.stderr}")
check_png(os.path.join(tmp, "made_up_plots", "balance.png"), 900, min_height=900)
m_train, m_evals = read_jsonl(made)
check_balance_data(os.path.join(tmp, "made_up_plots", "data"), m_train, m_evals, "made-up")


def zero_bias(rec):
    made_up(rec)
    for layer in rec["layers"]:
        layer.pop("balance_bias", None)
        if rec["kind"] == "train":
            layer["balance_bias"] = [0.0] * EXPERTS


rewrite_jsonl(os.path.join(run, "metrics.jsonl"), made, zero_bias)
r = plot(os.path.dirname(made), "--out", os.path.join(tmp, "zero_bias_plots"))
check(r.returncode == 0, f"zero bias: rc {r.returncode}\n{r.stderr}")
m_train, m_evals = read_jsonl(made)
check_balance_data(os.path.join(tmp, "zero_bias_plots", "data"), m_train, m_evals, "zero bias")
check_png(os.path.join(tmp, "zero_bias_plots", "balance.png"), 900)


def old_trainer(rec):
    """A run of a trainer from before the diagnostics."""
    rec.pop("layers", None) if rec["kind"] == "eval" else None
    for layer in rec.get("layers", []):
        for k in BALANCE_KEYS + ("group_top_share", "balance_bias"):
            layer.pop(k, None)


rewrite_jsonl(os.path.join(run, "metrics.jsonl"), made, old_trainer)
r = plot(os.path.dirname(made), "--out", os.path.join(tmp, "old_plots"))
check(r.returncode == 0 and "balance.png skipped" in r.stderr and
      not os.path.exists(os.path.join(tmp, "old_plots", "balance.png")) and
      len(r.stdout.split()) == 3 + LAYERS,
      f"old JSONL: the other images, balance.png skipped with a note: {r.returncode} {r.stderr}")

# --- Several runs: the PPL-CV scatter. ----------------------------------------------
out = os.path.join(tmp, "scatter")
r = plot("--scatter", runs["himoe"], runs["vanilla"] + "=vanilla GShard",
         os.path.join(runs["loss_free"], "metrics.jsonl"), "--out", out)
check(r.returncode == 0, f"--scatter: rc {r.returncode}\n{r.stderr}")
check_png(os.path.join(out, "ppl_vs_cv.png"), 900, min_bytes=5000)
header, blocks = read_table(os.path.join(out, "data", "ppl_vs_cv.dat"))
rows = blocks[0] if blocks else []
check(header == ["cv", "ppl", "step", "colour", "first", "label"] and len(rows) == 3,
      "ppl_vs_cv.dat rows")
for row, method, label in zip(rows, ("himoe", "vanilla", "loss_free"),
                              ("himoe", "vanilla_GShard", "loss_free")):
    train, evals = read_jsonl(os.path.join(runs[method], "metrics.jsonl"))
    mean_cv = sum(cv([sum(s["layers"][l]["expert_counts"][e] for s in train)
                      for e in range(EXPERTS)]) for l in range(LAYERS)) / LAYERS
    check(close(row[0], mean_cv) and abs(row[0] - reported_cv[method]) < 1e-4,
          f"{method}: CV {row[0]} = {mean_cv} (JSONL) ~ {reported_cv[method]} (trainer table)")
    check(close(row[1], evals[-1]["val_ppl"]) and row[2] == STEPS,
          f"{method}: ppl {row[1]} is the last evaluation's {evals[-1]['val_ppl']}")
    check(row[5] == label and row[4] == 1, f"{method}: label {row[5]} == {label}, first point")

# --cv steps: the mean over the last N steps of each step's layer-mean
# expert_cv; points that share a label share a colour, the first is labelled.
r = plot("--scatter", runs["himoe"] + "=A", runs["vanilla"] + "=B", runs["loss_free"] + "=A",
         "--out", out, "--cv", "steps", "--window", "5")
check(r.returncode == 0, f"--scatter --cv steps: rc {r.returncode}\n{r.stderr}")
header, blocks = read_table(os.path.join(out, "data", "ppl_vs_cv.dat"))
rows = blocks[0] if blocks else []
check(len(rows) == 3 and [(row[3], row[4], row[5]) for row in rows] ==
      [(1, 1, "A"), (2, 1, "B"), (1, 0, "A")], f"--cv steps: colours, first, labels: {rows}")
for row, method in zip(rows, ("himoe", "vanilla", "loss_free")):
    train, _ = read_jsonl(os.path.join(runs[method], "metrics.jsonl"))
    want = sum(sum(l["expert_cv"] for l in s["layers"]) / LAYERS for s in train[-5:]) / 5
    check(close(row[0], want, 1e-4), f"{method}: --cv steps x {row[0]} = {want}")

# --- Errors name the file. ---------------------------------------------------------
bad = os.path.join(tmp, "bad")
os.makedirs(bad)
missing = os.path.join(tmp, "nowhere")
r = plot(missing, "--out", os.path.join(tmp, "o1"))
check(r.returncode != 0 and missing in r.stderr, f"missing run: {r.returncode} {r.stderr}")
r = plot(bad, "--out", os.path.join(tmp, "o1"))
check(r.returncode != 0 and os.path.join(bad, "metrics.jsonl") + ": no such file" in r.stderr,
      f"run directory without metrics.jsonl: {r.returncode} {r.stderr}")
path = os.path.join(bad, "metrics.jsonl")
open(path, "w").close()
r = plot(bad, "--out", os.path.join(tmp, "o2"))
check(r.returncode != 0 and path in r.stderr and "no metrics" in r.stderr,
      f"empty JSONL: {r.returncode} {r.stderr}")
with open(os.path.join(runs["himoe"], "metrics.jsonl")) as f:
    lines = f.readlines()
with open(path, "w") as f:
    f.writelines(l for l in lines if '"kind":"eval"' not in l)
r = plot("--scatter", runs["vanilla"], bad, "--out", os.path.join(tmp, "o3"))
check(r.returncode != 0 and path in r.stderr and "no evaluation" in r.stderr,
      f"run without eval: {r.returncode} {r.stderr}")
with open(path, "w") as f:
    f.writelines(lines[:3] + ["{not json\n"] + lines[3:])
r = plot(bad, "--out", os.path.join(tmp, "o4"))
check(r.returncode != 0 and f"{path}:4" in r.stderr, f"bad JSON line: {r.returncode} {r.stderr}")

if failures:
    print(f"{len(failures)} check(s) failed; files kept in {tmp}", file=sys.stderr)
    sys.exit(1)
shutil.rmtree(tmp)
print("plot test passed")
