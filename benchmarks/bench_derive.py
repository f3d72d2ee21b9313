"""Cost of deriving the blocks' groups (adapters.derive) and of verifying a layout (adapters.accept).

For BERT-base (from config, 12 layers, h = 64) prints the seconds of ``layout()``, of
``derive_groups`` on a fresh cache (one derivation per distinct module signature: the 12 layers
share one QK and one VO derivation) and with the cache warm, and of the automatic verification
(``Layout.verify(per_block="auto")``).  ``--llama7b`` adds one Llama-7B-shaped decoder layer at
full width (hidden 4096, 32 heads of 128) derived on one gauge.

    python benchmarks/bench_derive.py [--seq 16] [--threads N] [--llama7b]
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
    import adapters
    from adapters import derive

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--llama7b", action="store_true")
    args = parser.parse_args()
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
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
