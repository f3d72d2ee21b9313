r"""Invariance check (paper ICML §6.2, docs/maths.md §11.5): sharpness of a reparametrised model.

One trained model (model 0 of the vision population, or of the text population with
``--model text``; trained here or loaded from ``--checkpoint-dir``) and one fixed set of
training batches. For each scale a, every head of every GL block is acted on by
A = a·G_rand (G_rand standard Gaussian per head, drawn once per run: ``layout.random_actions(
params, scale=a, cond=None)`` with a fixed generator), the weights are loaded into a copy of the
model, and adaptive / geodesic-inv / geodesic-mix sharpness are computed. Reported: the ratio
S(reparametrised)/S(original) per measure, and the largest change of the logits (the function must
not change). Geodesic sharpness should stay at 1 (up to float32 round-off and Auto-PGD's path),
adaptive sharpness moves (paper: 1.0–1.6 on BERT).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

import numpy as np
import torch

from quotient_manifolds import adapters
from quotient_manifolds.adapters import GEOMETRIES
from quotient_manifolds.adapters.losses import logits_of
from quotient_manifolds.adapters.worst_case import sharpness

from .options import float_list, sharpness_arguments
from .population import apply_sharp_overrides, default_out, log_line, set_threads
from .reporting import finish_figure, pyplot, smoke_test_banner
from .runner import ExperimentError, OutputDir, atomic_write_bytes, display_path, fmt_seconds, run_population
from .studies import STUDY

_STATE: Dict[str, Any] = {}


def _base(config: Dict[str, Any]):
    """(model, batches, population module) for this process, cached."""
    key = repr(sorted((k, repr(v)) for k, v in config.items()))
    if _STATE.get("key") == key:
        return _STATE["value"]
    mod = STUDY[config["model"]].load()
    pconf = config["population"]
    data = mod.load_data(pconf, config["data_dir"])
    model, hp, info = mod.get_model(0, pconf, data, config["ckpt_dir"], False)
    batches = mod.sharpness_batches(pconf, data)
    _STATE.update(key=key, value=(model, batches, mod, info))
    return _STATE["value"]


def reparametrise(model, scale: float, seed: int):
    """A copy of ``model`` with every GL block's heads acted on by A = scale·Gaussian."""
    lay = adapters.layout(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    actions = lay.random_actions(params, scale=scale, cond=None, generator=gen)
    return lay.reparametrised(model, actions).eval()


def _logits(model, batches):
    outs = []
    with torch.no_grad():
        for x, _ in batches:
            out = model(**x) if isinstance(x, dict) else model(x)
            outs.append(logits_of(out).double())
    return torch.cat(outs)


def job(item: int, config: Dict[str, Any], progress: bool) -> Dict[str, Any]:
    """Item 0 = the original model; item i ≥ 1 = scale ``config['scales'][i-1]``."""
    model, batches, _, info = _base(config)
    scale = None if item == 0 else config["scales"][item - 1]
    target = model if scale is None else reparametrise(model, scale, config["action_seed"])
    dev = 0.0
    if scale is not None:
        a, b = _logits(model, batches), _logits(target, batches)
        dev = float(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
    out: Dict[str, Any] = dict(scale=scale, logits_rel_change=dev, values={}, time_s={},
                               checkpoint=info["checkpoint"])
    for g in GEOMETRIES:
        t0 = time.perf_counter()
        res = sharpness(target, batches, geometry=g, rho=config["rho"][g],
                        n_iters=config["n_iters"])
        out["values"][g] = res.value
        out["time_s"][g] = time.perf_counter() - t0
    return out


def _figure(path: str, rows: List[Dict[str, Any]], base: Dict[str, float], title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(4.6, 3.0))
    scales = [r["scale"] for r in rows]
    for g in GEOMETRIES:
        ratios = [r["values"][g] / base[g] for r in rows]
        ax.plot(scales, ratios, marker="o", ms=3, label=g)
    ax.set_xscale("log")
    ax.axhline(1.0, color="k", lw=0.5)
    finish_figure(fig, ax, path, title=title, xlabel="action scale a (A = a·Gaussian per head)",
                  ylabel="sharpness ratio S(reparam.) / S(orig.)")


def add_arguments(p) -> None:
    """The study's options (``quotient-manifolds invariance --help``)."""
    sharpness_arguments(p)
    g = p.add_argument_group("invariance")
    g.add_argument("--model", choices=("vision", "text"), default="vision",
                   help="model 0 of the vision or text population")
    g.add_argument("--scales", type=float_list, default=None, metavar="A1,...",
                   help="action scales a (default: 9 in [1e-2, 1e2])")
    g.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="a population's checkpoints (default: DIR/checkpoints)")


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds invariance``: model 0 of a population, its sharpness at each action
    scale, the figure and the summary."""
    mod = STUDY[args.model].load()
    pconf = mod.defaults(args.quick, args.synthetic)
    apply_sharp_overrides(pconf, args)
    if args.seed is not None:
        pconf["seed"] = args.seed
    pconf.pop("models")
    if not args.synthetic:
        mod.require_data(pconf, args.data_dir)
    scales = args.scales or ([1e-2, 1.0, 1e2] if args.quick
                             else [float(a) for a in np.logspace(-2, 2, 9)])
    rho = {"adaptive": pconf["rho"]["adaptive"], "geodesic-inv": pconf["rho"]["inv"],
           "geodesic-mix": pconf["rho"]["mix"]}
    config = dict(model=args.model, population=pconf, scales=scales, rho=rho,
                  n_iters=pconf["n_iters"], action_seed=0 if args.seed is None else args.seed)
    out = os.path.abspath(args.out or default_out(f"invariance-{args.model}", args))
    started = time.perf_counter()
    with OutputDir(out, "invariance", config, force_mix=args.force_mix) as od:
        ckpt = os.path.abspath(args.checkpoint_dir or od.file("checkpoints"))
        log(f"invariance ({args.model} model 0, {len(scales)} scales) -> outputs in {od.path}\n"
            f"  results: {od.file('results.jsonl')}; figure: {od.file('fig_invariance.png')}")
        set_threads(1, args.threads)
        job_config = dict(config, data_dir=args.data_dir, ckpt_dir=ckpt)
        records, failed = run_population(od, job, range(len(scales) + 1),
                                         (job_config, not args.no_progress), workers=1,
                                         progress=not args.no_progress, log=log, desc="scales")
        by_item = {r["model_id"]: r for r in records}
        if 0 not in by_item:
            raise ExperimentError("the unreparametrised model failed; see errors.jsonl")
        base = by_item[0]["values"]
        rows = [by_item[i] for i in range(1, len(scales) + 1) if i in by_item]
        syn = " [SYNTHETIC]" if args.synthetic else ""
        _figure(od.file("fig_invariance.png"), rows, base,
                f"invariance: {args.model} model{syn}")
        lines = [f"# Invariance check: {args.model} model 0{syn}", "",
                 "> SYNTHETIC DATA — smoke test only.\n" if args.synthetic else "",
                 f"- output `{display_path(od.path)}`, checkpoint `{display_path(by_item[0]['checkpoint'])}`",
                 f"- A = a·G_rand per head (standard Gaussian, fixed seed), ρ = {rho}, "
                 f"{config['n_iters']} Auto-PGD iterations",
                 "- original sharpness: " + ", ".join(f"{g} {base[g]:.4g}" for g in GEOMETRIES),
                 "", "| a | max rel. logit change | " + " | ".join(f"{g} ratio" for g in GEOMETRIES)
                 + " |", "|---|---|" + "---|" * len(GEOMETRIES)]
        for r in rows:
            lines.append(f"| {r['scale']:.3g} | {r['logits_rel_change']:.1e} | " +
                         " | ".join(f"{r['values'][g] / base[g]:.4f}" for g in GEOMETRIES) + " |")
        spread = {g: (min(r["values"][g] / base[g] for r in rows),
                      max(r["values"][g] / base[g] for r in rows)) for g in GEOMETRIES} if rows else {}
        lines += ["", "Ratio range: " + "; ".join(f"{g} [{lo:.3f}, {hi:.3f}]"
                                                  for g, (lo, hi) in spread.items()), ""]
        banner = smoke_test_banner(pconf)          # a --quick run says so under the title
        lines[1:1] = banner
        atomic_write_bytes(od.file("summary.md"), ("\n".join(lines) + "\n").encode())
    for line in lines[5 + len(banner):]:
        log(line)
    log(f"invariance done in {fmt_seconds(time.perf_counter() - started)}; summary: "
        f"{os.path.join(out, 'summary.md')}")
    return 1 if failed else 0
