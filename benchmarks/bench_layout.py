"""Time ``adapters.layout()`` on full-size configs built on the meta device (no weights, no forward).

    python benchmarks/bench_layout.py

A 7B-parameter Llama-like decoder (Llama-2-7B shapes, 32 layers) and BERT-base.  Detection reads
only shapes, names and configuration, so it runs on meta tensors.
"""

from __future__ import annotations

import time

import torch
import transformers

from quotient_manifolds import adapters


def _time_layout(name: str, build) -> None:
    with torch.device("meta"):
        model = build()
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    layout = adapters.layout(model)
    dt = time.perf_counter() - t0
    print(f"{name:<28} {n_params / 1e9:6.2f} B parameters  {len(layout.blocks):4d} blocks  layout() {dt:7.2f} s")


def main() -> None:
    llama = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                     max_position_embeddings=4096)
    bert = transformers.BertConfig()        # bert-base-uncased shapes
    _time_layout("Llama-like 7B (meta)", lambda: transformers.LlamaForCausalLM(llama))
    _time_layout("BERT-base (meta)", lambda: transformers.BertForMaskedLM(bert))


if __name__ == "__main__":
    main()
