"""The GPU rows of the memory goal: a 7B decoder on an 80 GB card, a 13B on one H200.

Each row in a fresh process on the CUDA device: the decoder shape (bfloat16, from config, built on
the device), a bfloat16 forward+backward of 32 × 32 tokens timed, then ``sharpness`` with the
default or the compact solver (``solver_dtype=torch.bfloat16``), optionally under
``torch.cuda.set_per_process_memory_fraction`` so that the allocator refuses past the row's limit
in GiB (an 80 GB card, 80 GiB, simulated honestly). Prints, per row, seconds per Auto-PGD iteration against the
bf16 forward+backward, the peak GiB (``torch.cuda.max_memory_allocated``, weights included) and
bytes per parameter in total (weights included) and beyond the forward+backward's peak; an
out-of-memory row prints the library's error (its first 300 characters).

    python benchmarks/bench_gpu_memory.py [--rows qwen2-7b:adaptive:default qwen2-7b:geodesic-inv:default
        qwen2-7b:adaptive:compact:80 llama2-13b-shape:adaptive:compact] [--iters 4] [--json FILE]

A row is ``MODEL:GEOMETRY:SOLVER[:LIMIT_GIB]`` (models: ``bench_sharpness.DECODER_SHAPES``, or any
other model ``bench_sharpness.build`` knows). ``--device cpu`` runs the rows' logic on the CPU
(a smoke test of the script, e.g. ``--rows bert-base:adaptive:compact --batch 2 --seq 8``; no
peaks there).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_module
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROWS = ["qwen2-7b:adaptive:default", "qwen2-7b:geodesic-inv:default",
        "qwen2-7b:adaptive:compact:80", "qwen2-7b:geodesic-inv:compact:80",
        "llama2-13b-shape:adaptive:compact", "llama2-13b-shape:geodesic-inv:compact"]


def measure(row: str, args, queue) -> None:
    import torch

    from bench_sharpness import batch, build
    from quotient_manifolds import adapters

    model_name, geometry, solver, *limit = row.split(":")
    out = {"row": row}
    cuda = args.device == "cuda"
    try:
        if limit and cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            # an "80 GB" A100 or H100 has 80 GiB
            torch.cuda.set_per_process_memory_fraction(min(float(limit[0]) * 2 ** 30 / total, 1.0))
            out["limit_gib"] = float(limit[0])
        model = build(model_name, args.device)
        inputs, targets = batch(model, args.batch, args.seq, args.device)
        n = sum(p.numel() for p in model.parameters())
        out["params"] = n
        stamps = []

        def stamp(*_):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

        def peak_bytes():
            return torch.cuda.max_memory_allocated() if cuda else 0

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        stamp()
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(**inputs).logits.float(), targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
            stamp()
        out["fwd_bwd_s"] = min(b - a for a, b in zip(stamps, stamps[1:]))
        out["fwd_bwd_peak_gib"] = peak_bytes() / 2 ** 30
        del loss
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        stamps.clear()
        engine = sys.modules["quotient_manifolds.adapters.worst_case"]
        solver_run = engine.auto_pgd

        def timed(*a, **kw):
            kw["on_iteration"] = stamp
            stamp()
            return solver_run(*a, **kw)

        engine.auto_pgd = timed
        res = adapters.sharpness(model, [(inputs, targets)], geometry=geometry, rho=0.05,
                                 n_iters=args.iters, check_retraction=False,
                                 solver_dtype=torch.bfloat16 if solver == "compact" else None)
        times = [b - a for a, b in zip(stamps, stamps[1:])][1:-1]  # first (set-up) and last (fwd only) out
        peak = peak_bytes()
        out.update(value=res.value, iter_s=min(times) if times else None, peak_gib=peak / 2 ** 30,
                   bytes_per_param_total=peak / n,
                   bytes_per_param_beyond=(peak - out["fwd_bwd_peak_gib"] * 2 ** 30) / n,
                   n_forward=res.n_forward)
        out["ratio"] = out["iter_s"] / out["fwd_bwd_s"] if out["iter_s"] else None
    except Exception as err:  # an out-of-memory row is a result: the library's message
        out["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    queue.put(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=ROWS)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = []
    for row in args.rows:
        queue = ctx.Queue()
        proc = ctx.Process(target=measure, args=(row, args, queue))
        proc.start()
        got = None
        while got is None:  # a child that died without reporting (killed, crashed) is a row too
            alive = proc.is_alive()
            try:
                got = queue.get(timeout=5)
            except queue_module.Empty:
                if not alive:
                    got = {"row": row, "error": f"the process died (exit code {proc.exitcode})"}
        proc.join()
        results.append(got)
        if "error" in got:
            print(f"{row}: {got['error']}", flush=True)
        else:
            print(f"{row}: {got['params'] / 1e9:.2f} B params, fwd+bwd bf16 {got['fwd_bwd_s']:.3f} s "
                  f"(peak {got['fwd_bwd_peak_gib']:.1f} GiB), iteration {got['iter_s']:.3f} s "
                  f"({got['ratio']:.2f}x), peak {got['peak_gib']:.1f} GiB, "
                  f"{got['bytes_per_param_total']:.1f} B/param total, "
                  f"{got['bytes_per_param_beyond']:.1f} beyond the fwd+bwd, value {got['value']:.6g}",
                  flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
