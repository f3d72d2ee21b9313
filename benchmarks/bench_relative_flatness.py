"""Cost of relative flatness (``adapters.relative_flatness``) against one sharpness run, on MiniLM-L6.

Prints, for the packaged MiniLM-L6 (real weights, a fresh 2-label classifier head; the model and
batch of ``bench_sharpness.py``), seconds of

  * ``kappa-exact``: κ of the classifier (2×384: 2·384 = 768 Hessian-vector products),
  * ``kappa-probes``: κ of the classifier by Hutchinson (``--probes`` products) with its standard error,
  * ``kappa-ffn-out``: κ of the last feed-forward output projection (384×1536) by Hutchinson,
  * ``adaptive``: one adaptive sharpness run of ``--iters`` Auto-PGD iterations (the text study's
    setting: 10), and ``fwd+bwd``: one forward and backward of the batch,

each the median of ``--rounds`` rounds (the methods interleaved), with the ratio to the sharpness
run. Hessian-vector products with respect to the classifier go back through the head only, so the
exact κ costs about one forward pass plus the products.

    python benchmarks/bench_relative_flatness.py [--batch 32] [--seq 32] [--iters 10] [--probes 64]
                                                 [--rounds 3] [--threads 1] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ("fwd+bwd", "adaptive", "kappa-exact", "kappa-probes", "kappa-ffn-out")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--probes", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = p.parse_args(argv)

    import torch

    from bench_sharpness import batch, build
    from quotient_manifolds import adapters

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)                      # the fresh classifier head
    model = build("minilm", "cpu")
    inputs, targets = batch(model, args.batch, args.seq, "cpu")
    batches = [(inputs, targets)]
    ffn_out = f"bert.encoder.layer.{model.config.num_hidden_layers - 1}.output.dense"
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    found = {}

    def run(method):
        if method == "fwd+bwd":
            torch.nn.functional.cross_entropy(model(**inputs).logits, targets).backward()
            model.zero_grad(set_to_none=True)
        elif method == "adaptive":
            adapters.sharpness(model, batches, geometry="adaptive", rho=0.3, n_iters=args.iters,
                               check_retraction=False)
        elif method == "kappa-exact":
            found[method] = adapters.relative_flatness(model, batches, method="exact")
        elif method == "kappa-probes":
            found[method] = adapters.relative_flatness(model, batches, method="stochastic",
                                                       n_probes=args.probes)
        else:
            found[method] = adapters.relative_flatness(model, batches, layer=ffn_out,
                                                       n_probes=args.probes)

    times = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for m in METHODS:
            t0 = now()
            run(m)
            times[m].append(now() - t0)
    base = statistics.median(times["adaptive"])
    print(f"MiniLM-L6, batch {args.batch} x {args.seq} tokens, {args.threads} thread(s), {args.clock} "
          f"clock, median of {args.rounds} rounds; adaptive: {args.iters} Auto-PGD iterations")
    print(f"{'method':<14} {'seconds':>9} {'x adaptive run':>15}  value")
    for m in METHODS:
        t = statistics.median(times[m])
        r = found.get(m)
        what = ("" if r is None else
                f"κ = {r.value:.4g} ± {r.std_error:.2g} ({r.layer} {r.shape}, {r.method}, "
                f"{r.n_products} products)")
        print(f"{m:<14} {t:9.3f} {t / base:15.3f}  {what}")


if __name__ == "__main__":
    main()
