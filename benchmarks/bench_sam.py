"""Cost of one geodesic-SAM update relative to plain SAM.

Prints, for MiniLM-L6 (real weights) and BERT-base (from config), batch 32: seconds per update of
the base optimizer alone (one forward+backward and an AdamW step), SAM, ASAM (the adaptive geometry
with the first-order step) and geodesic SAM (mix, inv), and the ratios to SAM measured in ONE run.
Each method runs in its own process; methods are interleaved over ``--rounds`` rounds and the
table gives the median over all timed updates (the first ``--warmup`` updates of each process are
not timed: layout detection and first-call costs).

    python benchmarks/bench_sam.py [--models minilm bert-base] [--batch 32] [--seq 32]
                                   [--steps 6] [--rounds 2] [--threads N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sharpness import _sync, batch, build  # noqa: E402  (same models and batches)

#: method → GeodesicSAM keyword arguments (None: the base optimizer alone)
METHODS = {
    "adamw": None,
    "sam": dict(geometry="sam"),
    "asam": dict(geometry="adaptive", retraction="first_order"),
    "geodesic-mix": dict(geometry="geodesic-mix"),
    "geodesic-inv": dict(geometry="geodesic-inv"),
}


def measure(model_name: str, method: str, steps: int, warmup: int, size: int, seq: int,
            threads: int, device: str, queue) -> None:
    import torch

    from quotient_manifolds import adapters

    torch.set_num_threads(threads)
    model = build(model_name, device).train()
    inputs, targets = batch(model, size, seq, device)

    def closure():
        loss = torch.nn.functional.cross_entropy(model(**inputs).logits, targets)
        loss.backward()
        return loss

    kwargs = METHODS[method]
    if kwargs is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def update():
            opt.zero_grad(set_to_none=True)
            closure()
            opt.step()
    else:
        opt = adapters.GeodesicSAM(model, torch.optim.AdamW, rho=0.01, lr=1e-5, **kwargs)

        def update():
            opt.step(closure)
    times = []
    for k in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        update()
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - start)
    queue.put({"times": times})


def run_one(*args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"measurement {args[:2]} failed (exit code {proc.exitcode}); see above")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm", "bert-base"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=6, help="timed updates per process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates per process")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all methods")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    for model_name in args.models:
        times = {m: [] for m in METHODS}
        for _ in range(args.rounds):
            for method in METHODS:
                got = run_one(model_name, method, args.steps, args.warmup, args.batch, args.seq,
                              args.threads, args.device)["times"]
                times[method] += got
                # each measurement as it lands (stderr): a run cut short still shows what it had
                print(f"  {model_name} {method}: {statistics.median(got):.4f} s/update",
                      file=sys.stderr, flush=True)
        med = {m: statistics.median(t) for m, t in times.items()}
        print(f"{model_name}: s per update (median), ratio to SAM")
        for m, t in med.items():
            print(f"  {m:14s} {t:8.3f}  {t / med['sam']:6.3f}")
    print(f"settings: batch {args.batch}, {args.seq} tokens, threads {args.threads}, device "
          f"{args.device}, {args.steps} updates x {args.rounds} rounds, load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
