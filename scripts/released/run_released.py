#!/usr/bin/python3
"""Run the authors' released Hi-MoE code (brain-lab-research/Hi-MoE, checkout in
--checkout, e.g. a clone of github.com/brain-lab-research/Hi-MoE) on the himoe
study's fixed config (scripts/repro.sh), and measure it the way
himoe-trainer does.

It runs THEIR train.py unchanged (runpy, their configurator with --key=value
overrides) and only adds, from outside their files:
  * the shim (sitecustomize.py beside this file): torch._dynamo / matplotlib / seaborn /
    wandb stubs, loaded here if PYTHONPATH does not already provide them;
  * GPT.forward wrapped to pass idx/targets .contiguous() (their CPU get_batch,
    train.py:395-396, hands a strided slice to the model, which calls
    targets.view(-1) at model.py:2043);
  * torch.manual_seed wrapped to add (seed - 1337): train.py:361 hard-codes
    torch.manual_seed(1337) and has no seed option; --seed 1337 is therefore
    exactly their default run;
  * forward hooks on each MoE router (hard counts of (token, expert)
    assignments per layer and step) and on the GPT module (pure CE of the
    training batch, step timing).

After training (N optimizer updates: their max_iters = N - 1, because their
loop runs iterations 0..max_iters inclusive, train.py:904-909; lr_decay_iters = N
gives the same lr per update as himoe-trainer's schedule) it evaluates:
  * pure validation cross-entropy over FIXED windows: the first --eval_windows
    non-overlapping windows of block_size+1 tokens at offsets i*block_size of
    val.bin (what himoe-trainer's EvalWindows does), in batches of batch_size,
    eval mode, under a forked RNG seeded 0 (st_moe's eval policy is random);
  * their own estimate_loss() at the end (--their_eval_iters random batches of
    each split; the number their wandb logs as val/loss, aux terms included),
    with their tracker's expert CV and their dispatch CV, for reference.

Outputs in --out: metrics.jsonl (kind=train lines per step, kind=eval line),
result.json (summary), result.csv (one row), train.log is whatever the caller
redirects stdout to.
"""
import argparse
import csv
import json
import math
import os
import runpy
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

METHODS = ('vanilla', 'moge', 'himoe', 'st_moe', 'loss_free')


def method_overrides(method):
    """Their config keys per method (their train.py globals, lines 198-248)."""
    common_router = dict(
        n_exp=8, stride=1,                        # every layer is MoE
        train_capacity=2.0, eval_capacity=2.0,    # as in config/examples/*
        use_switch_tfm_init=True, switch_tfm_init_scale=0.1,
        router_use_full_prec=True, use_noisy_top_k=False,
        aux_loss_type='switch', aux_loss_weight=0.01, router_z_loss_weight=0.001,
        analysis_n_groups=4,
    )
    if method == 'vanilla':      # config/examples/train_nano_moe_vanilla.py (top_k = total K)
        m = dict(moe_type='vanilla', top_k=4, n_groups=1,
                 use_aux_loss=True, use_router_z_loss=True,
                 use_himoe_penalty=False, use_himoe_regularization=False)
    elif method == 'moge':       # config/examples/train_nano_moe_groups.py (top_k per group)
        m = dict(moe_type='moge', top_k=1, n_groups=4, use_router_scale=True,
                 use_aux_loss=True, use_router_z_loss=True,
                 use_himoe_penalty=False, use_himoe_regularization=False,
                 himoe_tau=0.0, himoe_beta=0.9, himoe_lambda1=0.0, himoe_lambda2=0.0)
    elif method == 'himoe':      # config/examples/train_nano_moe_himoe.py
        m = dict(moe_type='moge', top_k=1, n_groups=4, use_router_scale=True,
                 use_aux_loss=True, use_router_z_loss=True,
                 use_himoe_penalty=True, himoe_tau=0.01, himoe_beta=0.9, himoe_temperature=1.0,
                 use_himoe_regularization=True, himoe_lambda1=0.1, himoe_lambda2=0.05)
    elif method == 'st_moe':     # STMoERouter (model.py:463); no example config ships
        m = dict(moe_type='stmoe', top_k=4, n_groups=1,
                 use_aux_loss=True, use_router_z_loss=True,
                 second_policy_train='random', second_policy_eval='random',
                 second_threshold_train=0.2, second_threshold_eval=0.2,
                 use_himoe_penalty=False, use_himoe_regularization=False)
    elif method == 'loss_free':  # LossFreeMoERouter (model.py:879); no example config ships
        m = dict(moe_type='lossfree', top_k=4, n_groups=1, bias_update_rate=0.001,
                 use_aux_loss=False, use_router_z_loss=False,
                 use_himoe_penalty=False, use_himoe_regularization=False)
    else:
        raise SystemExit(f'unknown method {method!r} (one of {", ".join(METHODS)})')
    common_router.update(m)
    return common_router


def their_commit(checkout):
    """The checkout's git commit, or the contents of its COMMIT file, or None."""
    import subprocess
    try:
        return subprocess.run(['git', '-C', checkout, 'rev-parse', 'HEAD'], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        path = os.path.join(checkout, 'COMMIT')
        return open(path).read().strip() if os.path.exists(path) else None


def fmt(v):
    """A value their configurator's literal_eval turns back into the same type."""
    if isinstance(v, bool):
        return 'True' if v else 'False'
    if isinstance(v, float):
        return repr(float(v))
    return str(v)


def cv(counts):
    """Population std / mean (the paper's eq. (load); himoe's expert_cv)."""
    n = len(counts)
    mean = sum(counts) / n
    if mean <= 0:
        return 0.0
    return math.sqrt(sum((c - mean) ** 2 for c in counts) / n) / mean


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--method', required=True, choices=METHODS)
    ap.add_argument('--seed', type=int, default=1337)
    ap.add_argument('--iters', type=int, default=600, help='optimizer updates')
    ap.add_argument('--out', required=True)
    ap.add_argument('--checkout', required=True, help="a checkout of the authors' code")
    ap.add_argument('--data', required=True,
                    help='dir with train.bin, val.bin, meta.pkl (prepare_fortunes.py)')
    ap.add_argument('--eval_windows', type=int, default=64)
    ap.add_argument('--last', type=int, default=50, help='steps averaged for the train CV')
    ap.add_argument('--log_interval', type=int, default=50, help="their progress line + dispatch CV")
    ap.add_argument('--their_eval_iters', type=int, default=20,
                    help='batches per split for their estimate_loss() at the end (0: skip)')
    ap.add_argument('--bias', action='store_true', help='their bias=True (default False, their default)')
    ap.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                    help='extra override of their config, passed to their configurator')
    ap.add_argument('--cpu_autocast_bf16', action='store_true',
                    help="their forward under torch.autocast('cpu', bfloat16), as they run it on "
                         "GPUs (train.py's ctx is nullcontext() on the CPU)")
    a = ap.parse_args()
    if a.iters < 1:
        raise SystemExit('--iters must be >= 1')

    out = os.path.abspath(a.out)
    data = os.path.abspath(a.data)
    checkout = os.path.abspath(a.checkout)
    os.makedirs(out, exist_ok=True)
    for f in ('train.bin', 'val.bin', 'meta.pkl'):
        if not os.path.exists(os.path.join(data, f)):
            raise SystemExit(f'{data}/{f} missing: run /usr/bin/python3 {HERE}/prepare_fortunes.py')

    # glibc: their experts run on [n_exp * capacity, d_ff] buffers of exactly 32 MiB here
    # (8 x 2048 x 512 fp32), at the largest mmap threshold glibc accepts, so each step
    # mmaps and page-faults them afresh, several times slower a step (see docs/benchmarks.md,
    # Measurements behind choices in the code). Serve them
    # from the heap instead: M_MMAP_MAX = 0, unless the caller set MALLOC_MMAP_MAX_.
    if 'MALLOC_MMAP_MAX_' not in os.environ:
        try:
            import ctypes
            libc = ctypes.CDLL('libc.so.6')
            libc.mallopt(-4, 0)                   # M_MMAP_MAX
            libc.mallopt(-1, 256 << 20)           # M_TRIM_THRESHOLD
            libc.mallopt(-2, 16 << 20)            # M_TOP_PAD
        except OSError:
            pass

    import torch
    try:
        import torch._dynamo  # noqa: F401  (torch >= 2, or the shim via PYTHONPATH)
    except ImportError:
        runpy.run_path(os.path.join(HERE, 'sitecustomize.py'))
        import torch._dynamo  # noqa: F401
    import numpy as np
    import torch.nn.functional as F

    sys.path.insert(0, checkout)
    os.chdir(checkout)  # train.py execs 'configurator.py' relative to the cwd
    import model as their_model

    # ---- configuration: their train.py globals, overridden via their configurator ----
    cfg = dict(
        out_dir=out, dataset=data,  # os.path.join('data', <abs>) == <abs>
        init_from='scratch', wandb_log=False, compile=False, device='cpu', dtype='float32',
        n_layer=4, n_head=4, n_embd=128, block_size=128, dropout=0.0, bias=bool(a.bias),
        batch_size=16, gradient_accumulation_steps=1,
        learning_rate=1e-3, min_lr=1e-4, warmup_iters=30, decay_lr=True,
        max_iters=a.iters - 1, lr_decay_iters=a.iters,
        weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0,
        eval_interval=10 ** 9, eval_iters=1, always_save_checkpoint=False,  # only the iter-0 eval
        log_interval=a.log_interval, dispatch_metrics_interval=a.log_interval,
        train_moe_metrics_interval=a.log_interval,
        eval_moe_metrics=False, eval_dispatch_metrics=False,
        log_expert_balance=True, track_expert_activations=False, plot_interval=0,
    )
    cfg.update(method_overrides(a.method))
    argv = ['train.py'] + [f'--{k}={fmt(v)}' for k, v in cfg.items()] + [
        s if s.startswith('--') else '--' + s for s in a.set]

    # ---- outside patches (no edits to their files) ----
    seed_delta = a.seed - 1337
    orig_manual_seed = torch.manual_seed

    def manual_seed(s):
        return orig_manual_seed(int(s) + seed_delta)
    torch.manual_seed = manual_seed

    orig_forward = their_model.GPT.forward

    def forward(self, idx, targets=None, *args, **kw):
        idx = idx.contiguous()
        if targets is not None:
            targets = targets.contiguous()
        return orig_forward(self, idx, targets, *args, **kw)
    their_model.GPT.forward = forward

    state = dict(mode='idle', cur=None)  # mode: 'train' records training forwards, 'eval' fixed windows
    steps = []                           # one dict per training forward (= per update, grad_accum 1)
    eval_counts = {}
    n_exp = cfg['n_exp']
    routers = []

    def router_hook(layer):
        def hook(module, inputs, ro):
            rec = state['cur']
            if rec is None:
                return
            with torch.no_grad():
                sel = ro.expert_indices[ro.selection_mask].reshape(-1)
                counts = torch.bincount(sel, minlength=n_exp).tolist()
                disp = ro.used_capacity.tolist()
            if state['mode'] == 'train':
                rec['layers'].append(dict(
                    layer=layer, expert_counts=counts, dispatched=disp,
                    capacity=int(ro.capacity),
                    load=float(ro.load_balance_loss), intra=float(ro.himoe_intra_loss),
                    inter=float(ro.himoe_inter_loss), z=float(ro.router_z_loss)))
            else:
                acc = eval_counts.setdefault(layer, [[0] * n_exp, [0] * n_exp])
                for i in range(n_exp):
                    acc[0][i] += counts[i]
                    acc[1][i] += disp[i]
        return hook

    def gpt_pre_hook(module, inputs):
        if state['mode'] == 'train' and module.training:
            rec = dict(t0=time.perf_counter(), layers=[])
            steps.append(rec)
            state['cur'] = rec
        elif state['mode'] == 'eval':
            state['cur'] = dict(layers=[])
        else:
            state['cur'] = None

    def gpt_hook(module, inputs, output):
        rec = state['cur']
        if rec is None or state['mode'] != 'train':
            return
        logits, loss = output[0], output[1]
        targets = inputs[1] if len(inputs) > 1 else None
        if loss is not None:
            rec['loss'] = float(loss.detach())
        if targets is not None:
            with torch.no_grad():
                rec['ce'] = float(F.cross_entropy(logits.detach().reshape(-1, logits.size(-1)),
                                                  targets.reshape(-1)))
        state['cur'] = None

    orig_init = their_model.GPT.__init__

    def init(self, config):
        orig_init(self, config)
        self.register_forward_pre_hook(gpt_pre_hook)
        self.register_forward_hook(gpt_hook)
        layer = 0
        for block in self.transformer.h:
            r = getattr(getattr(block, 'mlp', None), 'router', None)
            if r is not None:
                r.register_forward_hook(router_hook(layer))
                routers.append(r)
                layer += 1
    their_model.GPT.__init__ = init

    # ---- train with their script ----
    print(f'run_released: method={a.method} seed={a.seed} iters={a.iters} -> {out}', flush=True)
    print('run_released: their argv: ' + ' '.join(argv[1:]), flush=True)
    sys.argv = argv
    if a.cpu_autocast_bf16:
        # train.py takes `from contextlib import nullcontext` when it runs; its
        # only use is the CPU's ctx.
        import contextlib
        contextlib.nullcontext = lambda *args, **kw: torch.autocast('cpu', dtype=torch.bfloat16)
    state['mode'] = 'train'
    t_start = time.perf_counter()
    g = runpy.run_path(os.path.join(checkout, 'train.py'), run_name='__main__')
    t_end = time.perf_counter()
    state['mode'] = 'idle'
    state['cur'] = None
    torch.manual_seed = orig_manual_seed
    model = g['raw_model']
    if len(steps) != a.iters:
        raise SystemExit(f'expected {a.iters} training forwards, hooked {len(steps)}')

    # step times: from one training forward's start to the next's (data, fwd, bwd, clip,
    # AdamW, their logging); the last one ends when their loop returns.
    for i, rec in enumerate(steps):
        rec['seconds'] = (steps[i + 1]['t0'] if i + 1 < len(steps) else t_end) - rec['t0']
    tokens_per_step = cfg['batch_size'] * cfg['block_size'] * cfg['gradient_accumulation_steps']

    # ---- fixed-window validation ----
    bs, T = cfg['batch_size'], cfg['block_size']
    val = np.fromfile(os.path.join(data, 'val.bin'), dtype='<u2').astype(np.int64)
    n_windows = min((len(val) - 1) // T, a.eval_windows) if a.eval_windows > 0 else (len(val) - 1) // T
    ce_sum, n_tok, their_loss_sum, n_batches = 0.0, 0, 0.0, 0
    model.eval()
    state['mode'] = 'eval'
    t_eval = time.perf_counter()
    with torch.no_grad(), torch.random.fork_rng():
        orig_manual_seed(0)
        for first in range(0, n_windows, bs):
            idx = np.arange(first, min(first + bs, n_windows))
            w = np.stack([val[i * T:i * T + T + 1] for i in idx])
            x = torch.from_numpy(np.ascontiguousarray(w[:, :-1]))
            y = torch.from_numpy(np.ascontiguousarray(w[:, 1:]))
            logits, loss = model(x, y)
            ce_sum += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                            reduction='sum'))
            n_tok += y.numel()
            their_loss_sum += float(loss)
            n_batches += 1
    state['mode'] = 'idle'
    state['cur'] = None
    eval_seconds = time.perf_counter() - t_eval
    model.train()
    val_ce = ce_sum / n_tok

    # ---- their own end-of-run evaluation (reference: what their logs would show) ----
    theirs = {}
    if a.their_eval_iters > 0:
        g['eval_iters'] = a.their_eval_iters
        losses, moe_metrics = g['estimate_loss'](collect_expert_counts=True, collect_moe_metrics=True,
                                                 collect_dispatch_metrics=True)
        theirs = dict(eval_iters=a.their_eval_iters,
                      train_loss=float(losses['train']), val_loss=float(losses['val']),
                      **{k: float(v) for k, v in moe_metrics.items()})
        tracker = g.get('activation_tracker')
        if tracker is not None:
            _, mean_cv = tracker.compute_metrics()
            theirs['expert_activations_cv'] = float(mean_cv)

    # ---- metrics ----
    n_layers = len(routers)
    with open(os.path.join(out, 'metrics.jsonl'), 'w') as f:
        for s, rec in enumerate(steps, start=1):
            layers = [dict(expert_counts=L['expert_counts'], dispatched=L['dispatched'],
                           capacity=L['capacity'], expert_cv=cv(L['expert_counts']),
                           dispatched_cv=cv(L['dispatched']),
                           load=L['load'], intra=L['intra'], inter=L['inter'], z=L['z'])
                      for L in rec['layers']]
            f.write(json.dumps(dict(kind='train', step=s, loss=rec.get('loss'), task=rec.get('ce'),
                                    seconds=rec['seconds'],
                                    tokens_per_s=tokens_per_step / rec['seconds'],
                                    expert_cv=sum(L['expert_cv'] for L in layers) / max(len(layers), 1),
                                    layers=layers)) + '\n')
        f.write(json.dumps(dict(kind='eval', step=a.iters, windows=n_windows, val_loss=val_ce,
                                val_ppl=math.exp(val_ce), their_loss=their_loss_sum / n_batches,
                                layers=[dict(expert_counts=eval_counts[l][0], dispatched=eval_counts[l][1],
                                             expert_cv=cv(eval_counts[l][0]))
                                        for l in range(n_layers)])) + '\n')

    last = steps[-min(a.last, len(steps)):]
    cv_last = [sum(cv(r['layers'][l]['expert_counts']) for r in last) / len(last) for l in range(n_layers)]
    cv_last_disp = [sum(cv(r['layers'][l]['dispatched']) for r in last) / len(last) for l in range(n_layers)]
    cv_last_summed = [cv([sum(r['layers'][l]['expert_counts'][e] for r in last) for e in range(n_exp)])
                      for l in range(n_layers)]
    cv_val = [cv(eval_counts[l][0]) for l in range(n_layers)]
    secs = [r['seconds'] for r in steps]
    after5 = secs[5:] or secs
    timed = sorted(secs[5:40] or secs)
    drops = sum(sum(L['expert_counts']) - sum(L['dispatched']) for r in steps for L in r['layers'])
    assigned = sum(sum(L['expert_counts']) for r in steps for L in r['layers'])
    res = dict(
        method=a.method, seed=a.seed, iterations=a.iters,
        their_commit=their_commit(checkout),
        torch=torch.__version__, threads=torch.get_num_threads(),
        val_ce=val_ce, val_ppl=math.exp(val_ce), val_windows=n_windows, val_tokens=n_tok,
        val_their_loss=their_loss_sum / n_batches,
        expert_cv_last=sum(cv_last) / n_layers, expert_cv_last_per_layer=cv_last,
        expert_cv_last_dispatched_per_layer=cv_last_disp,
        expert_cv_last_summed_per_layer=cv_last_summed,
        expert_cv_val=sum(cv_val) / n_layers, expert_cv_val_per_layer=cv_val,
        last_steps=len(last),
        train_ce_last=sum(r['ce'] for r in last) / len(last),
        train_loss_last=sum(r['loss'] for r in last) / len(last),
        drop_rate=(drops / assigned) if assigned else 0.0,
        ms_per_iter_median_6_40=1000 * timed[len(timed) // 2],
        ms_per_iter_mean=1000 * sum(after5) / len(after5),
        tokens_per_s=tokens_per_step * len(after5) / sum(after5),
        train_seconds=t_end - t_start, eval_seconds=eval_seconds,
        theirs=theirs, config=cfg,
    )
    with open(os.path.join(out, 'result.json'), 'w') as f:
        json.dump(res, f, indent=1)
    cols = ['method', 'seed', 'iterations', 'val_ce', 'val_ppl', 'val_their_loss', 'expert_cv_last',
            'expert_cv_val', 'train_ce_last', 'drop_rate', 'ms_per_iter_median_6_40', 'tokens_per_s']
    with open(os.path.join(out, 'result.csv'), 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(cols + [f'expert_cv_last_L{l}' for l in range(n_layers)]
                   + [f'expert_cv_val_L{l}' for l in range(n_layers)])
        w.writerow([res[c] for c in cols] + cv_last + cv_val)
    print(f"run_released: {a.method} seed {a.seed}: val CE {val_ce:.4f} (ppl {math.exp(val_ce):.3f}; "
          f"their loss incl. aux {res['val_their_loss']:.4f}) on {n_windows} windows; "
          f"expert CV last {len(last)}: {' '.join(f'{c:.3f}' for c in cv_last)} (val "
          f"{' '.join(f'{c:.3f}' for c in cv_val)}); {res['ms_per_iter_median_6_40']:.0f} ms/iter, "
          f"{res['tokens_per_s']:.0f} tok/s", flush=True)


if __name__ == '__main__':
    main()
