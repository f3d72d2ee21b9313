r"""Retraction study: first-order (w + ξ) vs second-order (w + ξ − ½Γ(ξ, ξ)) vs exact geodesic.

Part A, error vs step size on real attention weights. For each GL block of model 0 of the
population (trained here or loaded from ``--checkpoint-dir``), and of the pretrained MiniLM's
first layer when available (real data only), a random horizontal direction ξ per head
(:meth:`GLQuotientGeometry.random_horizontal`, rescaled so that ‖ξ‖_F = ‖x₀‖_F per head: t is the
relative step) is followed for t ∈ [1e-4, 1]. Reference: the geodesic ODE integrated with RK4 and
128 steps (error ~(1/128)⁴). Reported: the relative error of each retraction in the total space and in the
GL-invariant product G Hᵀ (what the network computes), and the fitted log-log slopes (expected:
2 for first order, 3 for second order; the ``exact`` retraction of the library uses 32 RK4 steps).

Part B, effect on sharpness and τ: the population (default vision; by default its first 24 models,
``--models`` to change) is measured with geodesic-inv / inv-no-gamma / inv-exact and geodesic-mix /
mix-no-gamma / mix-exact at one ρ; reported are τ per retraction and the relative differences of
the sharpness values. The exact retraction costs ~15 s per batch of 128 images on the default ViT
(1 thread), so point ``--checkpoint-dir`` at the vision population's checkpoints to skip training.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from quotient_manifolds import adapters
from quotient_manifolds.core import GLQuotientGeometry

from . import text
from .options import positive_float, positive_int
from .population import default_out, log_line, run_population_study, transformer_config, \
    transformer_report_kwargs
from .reporting import pyplot, value_of
from .runner import ExperimentError, atomic_write_bytes
from .studies import STUDY

STEPS = [float(t) for t in np.logspace(-4, 0, 9)]
RETRACTION_MEASURES = ("geodesic-inv", "inv-no-gamma", "inv-exact",
                       "geodesic-mix", "mix-no-gamma", "mix-exact")


def block_sources(model, label: str) -> List[Tuple[str, Any, Dict[str, Any]]]:
    """[(label/block-name, block, params)] for every GL block of ``model``."""
    lay = adapters.layout(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    return [(f"{label}: {b.name}", b, params) for b in lay.blocks]


def retraction_errors(x0, n: int, metric: str, steps=STEPS, seed: int = 0, ref_steps: int = 128
                      ) -> Dict[str, Any]:
    """Relative errors of the first/second-order and exact (32-step) retractions against a
    ``ref_steps`` RK4 geodesic, for one block x0 = [G; H] of shape (heads, n+m, h) (G has n rows)
    and one random horizontal direction of Frobenius norm ‖x0‖ per head."""
    x0 = x0.to(torch.float64)
    heads, nm, h = x0.shape
    geom = GLQuotientGeometry(n, nm - n, h, metric)
    frame = geom.frame(x0)
    gen = torch.Generator().manual_seed(seed)
    xi = geom.random_horizontal(x0, unit=False, generator=gen)
    xi = xi * (x0.norm(dim=(-2, -1), keepdim=True) / xi.norm(dim=(-2, -1), keepdim=True))

    def prod(x):
        return x[..., :n, :] @ x[..., n:, :].mT

    p0 = prod(x0).norm()
    out: Dict[str, Any] = {"steps": list(steps), "total": {}, "product": {}}
    for name in ("first_order", "second_order", "exact"):
        out["total"][name], out["product"][name] = [], []
    for t in steps:
        ref, _ = geom.integrate_geodesic(x0, t * xi, steps=ref_steps)
        for name in ("first_order", "second_order", "exact"):
            y = frame.retract(t * xi, name)
            out["total"][name].append(float((y - ref).norm() / x0.norm()))
            out["product"][name].append(float((prod(y) - prod(ref)).norm() / p0))
    out["slopes"] = {}
    for name in ("first_order", "second_order"):
        e = np.array(out["product"][name])
        ts = np.array(steps)
        ok = (ts <= 1e-1) & (e > 1e-14)
        out["slopes"][name] = (float(np.polyfit(np.log(ts[ok]), np.log(e[ok]), 1)[0])
                               if ok.sum() >= 2 else float("nan"))
    return out


def part_a(sources, log=print, steps=STEPS) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for label, block, params in sources:
        x0 = block.gather(params).detach()
        for metric in ("inv", "mix"):
            try:
                results[f"{label} [{metric}]"] = retraction_errors(x0, block.n, metric, steps)
            except ValueError as err:  # rank-deficient block
                log(f"  skipped {label} [{metric}]: {err}")
    return results


def _figure_a(path: str, results: Dict[str, Any], title: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(7.6, 3.0), sharey=True)
    colors = {"first_order": "#d62728", "second_order": "#1f77b4", "exact": "#2ca02c"}
    for ax, metric in zip(axes, ("inv", "mix")):
        for key, res in results.items():
            if not key.endswith(f"[{metric}]"):
                continue
            for name, c in colors.items():
                e = np.maximum(np.array(res["product"][name]), 1e-17)
                ax.loglog(res["steps"], e, color=c, alpha=0.35, lw=0.8)
        for name, c in colors.items():
            ax.plot([], [], color=c, label=name)
        ax.set_title(f"{metric} metric", fontsize=9)
        ax.set_xlabel("relative step t", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("rel. error of G Hᵀ vs geodesic", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def value_differences(records) -> List[str]:
    """Notes: median/max over models of |S(retraction) − S(exact)| / S(exact)."""
    notes = []
    for metric in ("inv", "mix"):
        exact = f"{metric}-exact"
        for name, label in ((f"{metric}-no-gamma", "first order"),
                            (f"geodesic-{metric}", "second order")):
            rel = []
            for r in records:
                rho = next((e["rho"] for e in r.get("sharpness", []) if e["measure"] == exact),
                           None)
                if rho is None:
                    continue
                ex, v = value_of(r, exact, rho), value_of(r, name, rho)
                if math.isfinite(ex) and math.isfinite(v) and ex != 0:
                    rel.append(abs(v - ex) / abs(ex))
            if rel:
                notes.append(f"Part B, {metric}: |S({label}) − S(exact)| / S(exact) over "
                             f"{len(rel)} models: median {np.median(rel):.2e}, max {max(rel):.2e}")
    return notes


def add_arguments(p) -> None:
    """The study's options (``quotient-manifolds retraction --help``)."""
    g = p.add_argument_group("retraction")
    g.add_argument("--population", choices=("vision", "text"), default="vision",
                   help="population whose sharpness is recomputed")
    g.add_argument("--rho-inv", type=positive_float, default=None, help="ρ of the inv measures")
    g.add_argument("--rho-mix", type=positive_float, default=None, help="ρ of the mix measures")
    g.add_argument("--n-iters", type=positive_int, default=None, help="Auto-PGD iterations")
    g.add_argument("--sharp-points", type=positive_int, default=None,
                   help="training points sharpness is measured on")
    g.add_argument("--sharp-batch", type=positive_int, default=None, help="batch size of sharpness")


def run(args, log: Callable[[str], None] = log_line) -> int:
    """``quotient-manifolds retraction``: part A (error vs step on model 0's attention blocks) and
    part B (the population's sharpness with each retraction), and the report."""
    mod = STUDY[args.population].load()
    args.measures = list(RETRACTION_MEASURES)
    args.rho_sweep = []
    for k in ("rho_adaptive", "eps", "test_size", "layers", "train_size", "pool_size", "head"):
        if not hasattr(args, k):
            setattr(args, k, None)
    config = transformer_config(mod, args)
    if not args.quick:
        # exact retraction ≈ 60 s per measure per ViT model (1 thread): first 24 models by default
        config["models"] = min(config["models"], 24)
    if not args.synthetic:
        mod.require_data(config, args.data_dir)
    out = os.path.abspath(args.out or default_out(f"retraction-{args.population}", args))
    os.makedirs(out, exist_ok=True)
    ckpt = os.path.abspath(args.checkpoint_dir or os.path.join(out, "checkpoints"))

    # Part A: model 0 of the population (trained/checkpointed like the population's model 0)
    log(f"retraction part A: error vs step size -> {out}/fig_retraction_error.png")
    data = mod.load_data(config, args.data_dir)
    model0, _, _ = mod.get_model(0, config, data, ckpt, not args.no_progress)
    sources = block_sources(model0, f"{mod.NAME} model 0")
    if args.quick:  # a smoke run: one block (both metrics), the steps' slopes still fitted
        sources = sources[:1]
    if not args.synthetic:
        try:
            mini = text.build_model(dict(text.defaults(True, False), layers=1), seed=0)
            sources += block_sources(mini, "MiniLM pretrained")
        except ExperimentError:
            pass
    results = part_a(sources, log, STEPS[::2] if args.quick else STEPS)
    syn = " [SYNTHETIC]" if args.synthetic else ""
    _figure_a(os.path.join(out, "fig_retraction_error.png"), results,
              f"retraction error vs step (one line per block){syn}")
    atomic_write_bytes(os.path.join(out, "retraction_error.json"),
                       (json.dumps(results, indent=1) + "\n").encode())
    notes = ["Part A (error vs relative step t on real attention weights; log-log slope of the "
             "G Hᵀ error for t ≤ 0.1; expected 2 for first order, 3 for second order). "
             "Figure: fig_retraction_error.png; data: retraction_error.json."]
    for metric in ("inv", "mix"):
        sl = {name: [r["slopes"][name] for k, r in results.items() if k.endswith(f"[{metric}]")]
              for name in ("first_order", "second_order")}
        at1 = {name: [r["product"][name][-1] for k, r in results.items()
                      if k.endswith(f"[{metric}]")] for name in ("first_order", "second_order",
                                                                  "exact")}
        if sl["first_order"]:
            notes.append(
                f"{metric}: median slope first-order {np.nanmedian(sl['first_order']):.2f}, "
                f"second-order {np.nanmedian(sl['second_order']):.2f}; median G Hᵀ error at "
                f"t = 1: first {np.nanmedian(at1['first_order']):.2e}, second "
                f"{np.nanmedian(at1['second_order']):.2e}, exact(32 steps) "
                f"{np.nanmedian(at1['exact']):.2e} ({len(sl['first_order'])} blocks)")
    for n_ in notes[1:]:
        log("  " + n_)

    # Part B: population with each retraction
    kwargs = transformer_report_kwargs(mod, config, args.synthetic,
                                       STUDY[args.population].target)
    kwargs.update(main=list(RETRACTION_MEASURES), extra_main=[], ablations=[],
                  notes=notes + kwargs["notes"])
    kwargs["notes_fn"] = value_differences
    args.checkpoint_dir = ckpt
    args.out = out
    return run_population_study(mod, config, args, report_kwargs=kwargs, study="retraction", log=log)
