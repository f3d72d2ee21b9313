"""How much the compact solver (``solver_dtype=torch.bfloat16``) moves a sharpness value, next to
the value's spread over seeds.

For each seed (the batch drawn: MiniLM's real weights; the from-config models' weights and
batch), the value with the float32 solver and with the compact one, for each geometry; prints
per geometry the largest |compact − float32| / float32 over the seeds and the spread of the
float32 values over the seeds (their standard deviation / mean).

    python benchmarks/compact_solver_values.py [--models minilm bert-small] [--seeds 0 1 2]
                                               [--iters 10] [--batch 8] [--seq 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def model_and_batch(name: str, seed: int, size: int, seq: int):
    import torch
    import transformers

    from bench_sharpness import build

    transformers.logging.set_verbosity_error()
    if name == "minilm":
        model = build("minilm", "cpu")
    else:  # a 4-layer BERT of hidden 256 from config, its weights drawn with the seed
        torch.manual_seed(seed)
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
            num_labels=2)).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, model.config.vocab_size, (size, seq), generator=g)
    return model, ({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                   torch.randint(0, 2, (size,), generator=g))


def main(argv=None):
    import torch

    from quotient_manifolds import adapters

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm", "bert-small"])
    parser.add_argument("--geometries", nargs="+", default=["adaptive", "geodesic-mix", "geodesic-inv"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rho", type=float, default=0.05)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'model':10s} {'geometry':13s} {'float32 mean':>12s} {'seed spread':>11s} "
          f"{'max |compact-fp32|/fp32':>23s}")
    for name in args.models:
        for geometry in args.geometries:
            full, change = [], []
            for seed in args.seeds:
                model, batch = model_and_batch(name, seed, args.batch, args.seq)
                values = [adapters.sharpness(model, [batch], geometry=geometry, rho=args.rho,
                                             n_iters=args.iters, check_retraction=False,
                                             solver_dtype=dtype).value
                          for dtype in (None, torch.bfloat16)]
                full.append(values[0])
                change.append(abs(values[1] - values[0]) / abs(values[0]))
            mean = statistics.mean(full)
            spread = statistics.stdev(full) / abs(mean) if len(full) > 1 else float("nan")
            print(f"{name:10s} {geometry:13s} {mean:12.5g} {spread:11.2e} {max(change):23.2e}",
                  flush=True)
    print(f"settings: rho {args.rho}, {args.iters} iterations, batch {args.batch} x {args.seq}, "
          f"seeds {args.seeds}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
