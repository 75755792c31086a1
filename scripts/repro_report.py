#!/usr/bin/python3
"""repro_report.py: the tables and plots of the routing-method study
(scripts/repro.sh calls it at the end; rerun it by hand to redraw).

  repro_report.py --out DIR --steps N --seeds S1,S2,... --row 'LABEL|FLAGS'...
                  [--config TEXT] [--mode NAME] [--window 50]

Reads DIR/runs/<LABEL>/seed<S>/metrics.jsonl and writes into DIR:
  results.md   the study table (mean ± sample std over seeds), the balance
               diagnostics, the plots' links, the definitions
  results.csv  one line per row: mean and std of every number
  runs.csv     one line per run (row, seed), the numbers of that run
  plots/       ppl_vs_cv.png (himoe-plot --scatter, every finished run) and,
               for vanilla, moge, himoe and himoe+controller at the first seed,
               himoe-plot's images (heatmap.png, balance.png, loss.png, ...)

A run counts when its metrics.jsonl holds the train line of step N and an
eval line at step N; other runs are listed as missing. When a step appears
twice (a resumed run replays steps) the last line wins.
"""

import argparse
import csv
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
PLOT = os.path.join(ROOT, "trainer", "plot", "himoe-plot")
HEATMAP_ROWS = ("vanilla", "moge", "himoe", "himoe+controller")
TPS_SKIP = 5  # tokens/s leaves out the first steps (allocation, warm-up of the kernels)
CV_WORST_WINDOW = 100  # the controller's acceptance window


class ReportError(Exception):
    pass


def finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def mean(values):
    return sum(values) / len(values)


def cv(load):
    m = mean(load)
    if m <= 0:
        return 0.0
    return math.sqrt(sum((c - m) ** 2 for c in load) / len(load)) / m


# --- One run ----------------------------------------------------------------------------

def read_metrics(path):
    """(config, train {step: rec}, eval {step: rec}); the last line of a step wins."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    last = max((i for i, l in enumerate(lines) if l.strip()), default=-1)
    train, evals, config = {}, {}, {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:  # a run killed mid-write
                continue
            raise ReportError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            continue
        kind = rec.get("kind")
        if kind == "config":
            config = rec
        elif kind == "train" and isinstance(rec.get("step"), int):
            train[rec["step"]] = rec
        elif kind == "eval" and isinstance(rec.get("step"), int):
            evals[rec["step"]] = rec
    return config, train, evals


def layer_mean(rec, key):
    """Mean over MoE layers of layers[l][key]; None when a layer lacks it."""
    layers = rec.get("layers")
    if not isinstance(layers, list) or not layers:
        return None
    vals = [l.get(key) if isinstance(l, dict) else None for l in layers]
    return mean(vals) if all(finite(v) for v in vals) else None


def steps_mean(recs, key):
    """Per step the mean over layers, then the mean over the steps."""
    vals = [layer_mean(r, key) for r in recs]
    return mean(vals) if vals and all(v is not None for v in vals) else None


def counts_cv(recs):
    """Expert counts summed over the steps, CV per layer, mean over layers (the
    trainer's final balance table and himoe-plot --scatter's default)."""
    try:
        num_layers = len(recs[0]["layers"])
        per_layer = []
        for l in range(num_layers):
            n = len(recs[0]["layers"][l]["expert_counts"])
            per_layer.append(cv([sum(r["layers"][l]["expert_counts"][e] for r in recs)
                                 for e in range(n)]))
        return mean(per_layer)
    except (KeyError, IndexError, TypeError, ZeroDivisionError):
        return None


def worst_layer_cv(recs):
    """Max over layers of the layer's expert CV averaged over the steps."""
    try:
        num_layers = len(recs[0]["layers"])
        return max(mean([r["layers"][l]["expert_cv"] for r in recs]) for l in range(num_layers))
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None


# The numbers of one run: key, column title, format, definition.
METRICS = [
    ("val_ce", "val CE", "{:.3f}", "cross-entropy of the last evaluation (`val_loss`, task loss only)"),
    ("val_ppl", "val PPL", "{:.3f}", "exp(val CE), per run, then mean ± std"),
    ("cv", "expert CV (last 50)", "{:.3f}",
     "per step the mean over layers of `expert_cv`, then the mean over the last 50 steps"),
    ("cv_val", "expert CV (val)", "{:.3f}",
     "the last eval line's `layers[l].expert_cv`, mean over layers (the whole validation set)"),
    ("max_vio", "MaxVio", "{:.3f}", "`max_vio`, same last-50-step mean over layers"),
    ("group_cv", "group CV", "{:.3f}", "`group_cv`, same last-50-step mean over layers"),
    ("groups_per_token", "groups/token", "{:.2f}", "`groups_per_token`, same last-50-step mean"),
    ("tokens_per_s", "tokens/s", "{:.0f}",
     "mean of the train lines' `tokens_per_s`, the first 5 steps left out (all steps in runs of "
     "at most 5 steps)"),
    # Diagnostics.
    ("cv_counts", "expert CV (50-step counts)", "{:.3f}",
     "expert counts summed over the last 50 steps, CV per layer, mean over layers (the trainer's "
     "final table and the scatter's x)"),
    ("cv_worst", "worst layer CV (last 100)", "{:.3f}",
     "per layer the mean of `expert_cv` over the last 100 steps, max over layers"),
    ("top_share", "top share", "{:.3f}",
     "`top_share` (the top expert's share of its group; 1/S balanced, 1 collapsed), last-50-step mean"),
    ("load_entropy", "load entropy", "{:.3f}",
     "`load_entropy` (entropy of the expert load / log N; 1 uniform), last-50-step mean"),
    ("mean_pi_sq", "mean ‖π‖²", "{:.3f}", "`mean_pi_sq`, last-50-step mean"),
    ("top_share_val", "top share (val)", "{:.3f}", "`top_share` of the last eval line, mean over layers"),
    ("load_entropy_val", "load entropy (val)", "{:.3f}",
     "`load_entropy` of the last eval line, mean over layers"),
    ("seconds", "run time (s)", "{:.0f}", "sum of the train lines' `seconds`"),
]
MAIN_COLUMNS = ["val_ce", "val_ppl", "cv", "cv_val", "max_vio", "group_cv", "groups_per_token",
                "tokens_per_s"]
DIAG_COLUMNS = ["cv_counts", "cv_worst", "top_share", "load_entropy", "mean_pi_sq",
                "top_share_val", "load_entropy_val"]
SPEC = {k: (title, f, definition) for k, title, f, definition in METRICS}


def run_numbers(path, steps, window):
    """The numbers of one run, or (None, why) when it is not finished."""
    if not os.path.exists(path):
        return None, "not run"
    config, train, evals = read_metrics(path)
    if steps not in train:
        last = max(train, default=0)
        return None, f"unfinished (last train step {last} of {steps})"
    if steps not in evals or not finite(evals[steps].get("val_loss")):
        return None, f"no final evaluation at step {steps}"
    recs = [train[s] for s in sorted(train) if s <= steps]
    last = recs[-window:]
    final = evals[steps]
    val_ce = final["val_loss"]
    tps_recs = recs[TPS_SKIP:] if len(recs) > TPS_SKIP else recs
    tps = [r.get("tokens_per_s") for r in tps_recs]
    secs = [r.get("seconds") for r in recs]
    out = {
        "val_ce": val_ce,
        "val_ppl": math.exp(val_ce),
        "cv": steps_mean(last, "expert_cv"),
        "cv_val": layer_mean(final, "expert_cv"),
        "max_vio": steps_mean(last, "max_vio"),
        "group_cv": steps_mean(last, "group_cv"),
        "groups_per_token": steps_mean(last, "groups_per_token"),
        "tokens_per_s": mean(tps) if all(finite(t) for t in tps) else None,
        "cv_counts": counts_cv(last),
        "cv_worst": worst_layer_cv(recs[-CV_WORST_WINDOW:]),
        "top_share": steps_mean(last, "top_share"),
        "load_entropy": steps_mean(last, "load_entropy"),
        "mean_pi_sq": steps_mean(last, "mean_pi_sq"),
        "top_share_val": layer_mean(final, "top_share"),
        "load_entropy_val": layer_mean(final, "load_entropy"),
        "seconds": sum(secs) if all(finite(s) for s in secs) else None,
    }
    return out, "ok"


# --- Statistics and formatting ------------------------------------------------------------

def summarise(values):
    """(mean, sample std or None, n) over the runs that have the number."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None, 0
    return mean(vals), (statistics.stdev(vals) if len(vals) > 1 else None), len(vals)


def cell(key, summary):
    m, s, n = summary
    if m is None:
        return "-"
    f = SPEC[key][1]
    return f.format(m) if s is None else f"{f.format(m)} ± {f.format(s)}"


def md_escape(text):
    return text.replace("|", "\\|")


def git_revision():
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + ("+uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_plot(args, what):
    proc = subprocess.Popen([sys.executable, PLOT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate()
    except BaseException:  # a stop signal: himoe-plot stops its gnuplot on SIGTERM
        proc.terminate()
        proc.wait()
        raise
    if err.strip():
        sys.stderr.write(err)
    if proc.returncode != 0:
        print(f"repro_report: himoe-plot failed for {what}", file=sys.stderr)
        return False
    return True


def target_cv(flags):
    words = flags.split()
    for i, w in enumerate(words):
        if w == "--target_expert_cv" and i + 1 < len(words):
            return float(words[i + 1])
        if w.startswith("--target_expert_cv="):
            return float(w.split("=", 1)[1])
    return None


# --- The report -------------------------------------------------------------------------

def main(argv):
    p = argparse.ArgumentParser(prog="repro_report.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[2:]))
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--steps", required=True, type=int)
    p.add_argument("--seeds", required=True, help="comma-separated")
    p.add_argument("--row", action="append", required=True, metavar="LABEL|FLAGS",
                   help="a study row: its label and its trainer flags (repeat, in table order)")
    p.add_argument("--config", default="", help="the fixed trainer flags, for the record")
    p.add_argument("--mode", default="", help="full, quick or smoke, for the record")
    p.add_argument("--window", type=int, default=50, help="the last-N-step window (default 50)")
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",") if s]
    rows = []
    for r in a.row:
        label, _, flags = r.partition("|")
        rows.append((label, flags))
    out = os.path.abspath(a.out)
    plots = os.path.join(out, "plots")
    os.makedirs(plots, exist_ok=True)

    # Every run's numbers.
    per_run, missing = {}, []
    for label, _ in rows:
        for seed in seeds:
            path = os.path.join(out, "runs", label, f"seed{seed}", "metrics.jsonl")
            try:
                nums, why = run_numbers(path, a.steps, a.window)
            except (OSError, ReportError) as e:
                nums, why = None, str(e)
            if nums is None:
                missing.append(f"{label} seed {seed}: {why}")
            else:
                per_run[(label, seed)] = nums
    summary = {}
    for label, _ in rows:
        runs = [per_run[(label, s)] for s in seeds if (label, s) in per_run]
        summary[label] = {k: summarise([r[k] for r in runs]) for k in SPEC}
        summary[label]["n"] = len(runs)

    # Plots: the PPL-CV scatter over every finished run, himoe-plot's images of
    # the main rows at the first seed.
    plot_ok = True
    scatter = []
    for label, _ in rows:
        for seed in seeds:
            if (label, seed) in per_run:
                scatter.append(os.path.join(out, "runs", label, f"seed{seed}") + "=" + label)
    images = {}
    if scatter:
        if run_plot(["--scatter", *scatter, "--out", plots, "--window", str(a.window),
                     "--cv", "steps"], "the scatter"):
            images["scatter"] = "plots/ppl_vs_cv.png"
        else:
            plot_ok = False
    for label, _ in rows:
        if label not in HEATMAP_ROWS:
            continue
        seed = next((s for s in seeds if (label, s) in per_run), None)
        if seed is None:
            continue
        if run_plot([os.path.join(out, "runs", label, f"seed{seed}"), "--out",
                     os.path.join(plots, label), "--name", f"{label}, seed {seed}"],
                    f"{label} seed {seed}"):
            images[label] = (seed, [f for f in ("heatmap", "balance", "loss", "group_share")
                                    if os.path.exists(os.path.join(plots, label, f + ".png"))])
        else:
            plot_ok = False

    # results.csv and runs.csv.
    keys = [k for k, *_ in METRICS]
    with open(os.path.join(out, "results.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "flags", "runs"] + [f"{k}_{s}" for k in keys for s in ("mean", "std")])
        for label, flags in rows:
            sm = summary[label]
            w.writerow([label, flags, sm["n"]] +
                        ["" if v is None else f"{v:.6g}" for k in keys for v in sm[k][:2]])
    with open(os.path.join(out, "runs.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "seed"] + keys)
        for label, _ in rows:
            for seed in seeds:
                if (label, seed) in per_run:
                    w.writerow([label, seed] + ["" if per_run[(label, seed)][k] is None
                                                else f"{per_run[(label, seed)][k]:.6g}"
                                                for k in keys])

    # results.md.
    md = ["# Routing-method study", ""]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rev = git_revision()
    md.append(f"Made by `scripts/repro.sh{' --' + a.mode if a.mode and a.mode != 'full' else ''}` "
              f"on {when}{f' at commit {rev}' if rev else ''}: {len(rows)} rows × seeds "
              f"{', '.join(map(str, seeds))}, {a.steps} steps each, in-process experts, "
              f"one thread per run.")
    if a.config:
        md += ["", f"Fixed trainer flags: `{a.config}`"]
    md += ["", "Mean ± sample standard deviation (n − 1) over the seeds; `runs` is the number "
               "of finished runs. \"-\": not in these runs' metrics.", ""]
    head = ["row", "runs"] + [SPEC[k][0] for k in MAIN_COLUMNS]
    md.append("| " + " | ".join(head) + " |")
    md.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for label, _ in rows:
        sm = summary[label]
        md.append("| " + " | ".join([md_escape(label), str(sm["n"])] +
                                    [cell(k, sm[k]) for k in MAIN_COLUMNS]) + " |")

    md += ["", "## Balance diagnostics", ""]
    ref = "moge" if summary.get("moge", {}).get("n") else None
    best_label = min((l for l, _ in rows if summary[l]["val_ce"][0] is not None),
                     key=lambda l: summary[l]["val_ce"][0], default=None)
    head = ["row"] + ([f"val CE − {ref}"] if ref else []) + ["val CE − best"] + \
        [SPEC[k][0] for k in DIAG_COLUMNS]
    md.append("| " + " | ".join(head) + " |")
    md.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for label, _ in rows:
        sm = summary[label]
        ce = sm["val_ce"][0]
        deltas = []
        for other in ([ref] if ref else []) + [best_label]:
            oc = summary[other]["val_ce"][0] if other else None
            deltas.append("-" if ce is None or oc is None else f"{ce - oc:+.3f}")
        md.append("| " + " | ".join([md_escape(label)] + deltas +
                                    [cell(k, sm[k]) for k in DIAG_COLUMNS]) + " |")
    if best_label:
        md += ["", f"Lowest mean val CE: {best_label} ({summary[best_label]['val_ce'][0]:.3f})."]
    for label, flags in rows:
        t = target_cv(flags)
        sm = summary[label]
        if t and sm["n"]:
            worst = [per_run[(label, s)]["cv_worst"] for s in seeds if (label, s) in per_run]
            worst = [w for w in worst if w is not None]
            if worst:
                verdict = "within" if max(worst) <= t else "ABOVE"
                md.append(f"{label}: target expert CV {t:g}; worst layer's mean CV over the last "
                          f"{CV_WORST_WINDOW} steps, per seed: "
                          f"{', '.join(f'{w:.3f}' for w in worst)} ({verdict} the target).")

    md += ["", "## Plots", ""]
    if "scatter" in images:
        md += ["Validation perplexity against expert CV (x: the table's `expert CV (last "
               f"{a.window})`), one point per run:", "",
               f"![PPL against expert CV]({images['scatter']})", ""]
    for label in HEATMAP_ROWS:
        if label in images:
            seed, files = images[label]
            md.append(f"**{label}** (seed {seed}): expert activation per layer, balance "
                      "diagnostics (top share in group, load entropy, mean ‖π‖², controller bias)"
                      + (", training curves" if "loss" in files else "") + ".")
            md.append("")
            for f in files:
                if f in ("heatmap", "balance"):
                    md.append(f"![{label} {f}](plots/{label}/{f}.png)")
            others = [f for f in files if f not in ("heatmap", "balance")]
            if others:
                md += ["", "Also: " + ", ".join(f"[{f}](plots/{label}/{f}.png)" for f in others)
                       + "."]
            md.append("")
    if not images:
        md += ["(no finished runs to draw)", ""]

    md += ["## Rows", ""]
    for label, flags in rows:
        md.append(f"- `{label}`: `{flags}`")
    md += ["", "## Definitions", ""]
    for k in MAIN_COLUMNS + DIAG_COLUMNS:
        md.append(f"- **{SPEC[k][0]}**: {SPEC[k][2]}.")
    md.append("- **val CE − X**: the row's mean val CE minus row X's.")
    if missing:
        md += ["", "## Missing runs", ""] + [f"- {m}" for m in missing]
    md += ["", "Per run: `runs.csv`; per row, mean and std: `results.csv`; each run's "
               "`metrics.jsonl`, `train.log` and trainer flags (`args`) under "
               "`runs/<row>/seed<seed>/`.", ""]
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md))

    # The main table on stdout too.
    print(f"\n{'row':<18} {'runs':>4} {'val CE':>15} {'val PPL':>15} {'CV last50':>15} "
          f"{'CV val':>7} {'MaxVio':>7} {'tok/s':>6}")
    for label, _ in rows:
        sm = summary[label]
        print(f"{label:<18} {sm['n']:>4} {cell('val_ce', sm['val_ce']):>15} "
              f"{cell('val_ppl', sm['val_ppl']):>15} {cell('cv', sm['cv']):>15} "
              f"{cell('cv_val', (sm['cv_val'][0], None, 0)):>7} "
              f"{cell('max_vio', (sm['max_vio'][0], None, 0)):>7} "
              f"{cell('tokens_per_s', (sm['tokens_per_s'][0], None, 0)):>6}")
    print(f"\n{os.path.join(out, 'results.md')} (and results.csv, runs.csv, plots/)")
    if missing:
        print(f"repro_report: {len(missing)} run(s) missing or unfinished:\n  " +
              "\n  ".join(missing), file=sys.stderr)
    return 0 if plot_ok else 1


if __name__ == "__main__":
    # A stop signal unwinds, so that run_plot stops the himoe-plot it waits on.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(main(sys.argv[1:]))
    except ReportError as e:
        print(f"repro_report: {e}", file=sys.stderr)
        sys.exit(1)
