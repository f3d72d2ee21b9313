"""Cost of deriving the blocks' groups (adapters.derive) and of verifying a layout (adapters.accept).

Two parts:

* ``--h 16 64``: one head, before / after.  *Before*: the null space of the linearised invariance
  condition (``derive_algebra``: h² directional derivatives, Gram matrix and eigh of h² × h²) and
  ``recognise_algebra``, what every derivation cost until closed forms were screened.  *After*:
  ``derive_group`` (screen the closed forms with two random elements each, certify the largest
  that passes with one directional derivative per irreducible component of its complement; the
  null space only when that fails).  Workloads: RoPE scores (rotary commutant), L2-normalised q and
  k (R₊·SO(h)), a normalised head output mixed by W_O (SO(h)), plain scores (GL(h)); T = 3h tokens
  (with fewer, the null space of the normalised workloads is larger than the algebra and not closed;
  the screened path, whose certificate holds for any inputs, still finds the group).
* BERT-base (from config, 12 layers, h = 64): seconds of ``layout()``, of ``derive_groups`` on a
  fresh cache (one derivation per distinct module signature) and with the cache warm, and of the
  automatic verification (``Layout.verify(per_block="auto")``).  ``--llama7b`` adds one
  Llama-7B-shaped decoder layer at full width (hidden 4096, 32 heads of 128).

    python benchmarks/bench_derive.py [--h 16 64] [--skip-before] [--skip-models] [--seq 16]
                                      [--threads N] [--llama7b]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def bench(name: str, model, inputs) -> None:
    from quotient_manifolds import adapters
    from quotient_manifolds.adapters import derive

    lay, t_layout = _timed(lambda: adapters.layout(model, allow_unsupported=True))
    derive.clear_cache()
    (derived, results), t_cold = _timed(lambda: derive.derive_groups(model, lay, inputs))
    _, t_warm = _timed(lambda: derive.derive_groups(model, lay, inputs))
    _, t_verify = _timed(lambda: derived.verify(model, inputs, per_block="auto", raise_on_failure=False))
    fresh = [r for r in results if not r.cached]
    each = ", ".join(f"{r.block.rsplit('/', 1)[1]} {r.seconds:.2f}s dim {r.dim} {r.status}" for r in fresh)
    print(f"{name}: {len(lay.blocks)} blocks, {len(fresh)} derived afresh ({each})")
    print(f"  layout {t_layout:.2f}s | derive cold {t_cold:.2f}s, warm {t_warm:.2f}s | "
          f"verify {t_verify:.2f}s | layout + derive {t_layout + t_cold:.2f}s")


def workloads(h: int, gen):
    """(name, output_of, G, H) for one head of dimension h."""
    import math

    import torch
    import torch.nn.functional as F

    tokens = max(math.ceil(math.sqrt(2 * h * h)), 3 * h)    # normalised q, k need T ≳ 3h to fix the null space
    X, Y = (torch.randn(tokens, 2 * h, dtype=torch.float64, generator=gen) for _ in range(2))
    G, H = (torch.randn(2 * h, h, dtype=torch.float64, generator=gen) for _ in range(2))
    pos = torch.arange(tokens, dtype=torch.float64)
    ang = pos[:, None] * 100.0 ** (-torch.arange(h // 2, dtype=torch.float64) * 2 / h)[None, :]
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)

    def rot(v):
        return v * cos + torch.cat((-v[..., h // 2:], v[..., : h // 2]), -1) * sin

    att = torch.softmax(torch.randn(tokens, tokens, dtype=torch.float64, generator=gen), -1)
    return [("RoPE scores", lambda g, k: rot(X @ g) @ rot(Y @ k).T, G, H),
            ("normalised q, k", lambda g, k: F.normalize(X @ g, dim=-1) @ F.normalize(Y @ k, dim=-1).T, G, H),
            ("normalised head output", lambda g, k: F.normalize(att @ X @ g, dim=-1) @ k.T, G, H),
            ("plain scores", lambda g, k: X @ g @ k.T @ Y.T, G, H)]


def bench_heads(dims, before: bool) -> None:
    import torch

    from quotient_manifolds.core.algebra import derive_algebra, derive_group, recognise_algebra

    gen = torch.Generator().manual_seed(0)
    for h in dims:
        for name, f, G, H in workloads(h, gen):
            derive_group(f, G, H)                    # warm-up (torch.func tracing)
            after, t_after = _timed(lambda: derive_group(f, G, H))
            line = (f"h={h:3d} {name:24s} after {t_after:7.2f} s ({after.evaluations:5d} directional "
                    f"derivatives, {after.method}) -> {after.group.describe(h)}")
            if before:
                d, t_before = _timed(lambda: derive_algebra(f, G, H))
                if after.method == "invariant":      # the previous pipeline's exact-invariance check
                    found = "GL (spectrum at rounding)"
                else:
                    found = recognise_algebra(d.basis, h).describe(h) if d.closed else f"not closed (dim {d.dim})"
                line += f" | before {t_before:7.2f} s ({h * h} derivatives + h²×h² eigh) -> {found}"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--h", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--skip-before", action="store_true", help="only time derive_group")
    parser.add_argument("--skip-models", action="store_true", help="only the one-head part")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--llama7b", action="store_true")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    bench_heads(args.h, not args.skip_before)
    if args.skip_models:
        return
    import transformers

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig()).eval()     # BERT-base shapes
    bench("BERT-base", bert, {"input_ids": torch.randint(0, 30522, (1, args.seq))})
    if args.llama7b:
        cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                       num_key_value_heads=32, num_hidden_layers=1, vocab_size=256)
        llama = transformers.LlamaForCausalLM(cfg).eval()
        bench("Llama-7B layer", llama, torch.randint(0, 256, (1, args.seq)))


if __name__ == "__main__":
    main()
