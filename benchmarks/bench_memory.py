"""Bytes per parameter that sharpness holds beyond the model's weights and one forward+backward.

For a Qwen2-shaped decoder from config (random weights; ``--layers``/``--hidden`` set its size) in
float32 and in bfloat16, each measurement in a fresh process, on the CPU:

* ``fwd+bwd``: a forward and backward of the batch in the compute dtype (float32; a bfloat16
  model is converted first, as sharpness evaluates it in float32) in which each weight's gradient
  is dropped as soon as it is formed (a post-accumulate-grad hook): its peak over the loaded
  model is A, the activations of one forward+backward with the gradient of one weight at a time
  (what a pass needs at least: gradients are not activations, and keeping all of them would
  count 4 bytes per parameter that sharpness never holds);
* ``adaptive``, ``geodesic-mix``, ``geodesic-inv``: ``adapters.sharpness`` on the same batch,
  without the worst point's gradient (``lean``: ``solver.KEEP_WORST_GRADIENT = False``, the
  default where memory is short) and keeping it (``kept``: 4 bytes more, the default where it
  fits); ``--full-step`` stores the solver's last step in float32 (``solver.COMPACT_STEP =
  False``: 2 bytes more), as before it was kept in bfloat16.

``bytes/param`` = (peak − A) / parameters, the peak of the process's RSS over the model as loaded
(Linux VmHWM, reset after loading; it counts the allocator's caching): what sharpness holds beyond
the model's own weights and the activations of one forward+backward. The target is ≤ 16; the
solver holds 14 (ξ, the worst point and the gradient in float32, the last step in bfloat16), and
the largest weight's transients in the backward (its recomputed value: the tied embedding here)
add a little on a model this small. ``tensors`` is the peak of the tensors the run holds from Python
(:class:`LiveTensorBytes`). On a CUDA device (``--device cuda``) the peak is
``torch.cuda.max_memory_allocated``.

    python benchmarks/bench_memory.py [--layers 12] [--hidden 512] [--batch 2] [--seq 64]
                                      [--iters 6] [--dtypes float32 bfloat16] [--device cpu]
                                      [--full-step]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

METHODS = ("fwd+bwd", "adaptive", "geodesic-mix", "geodesic-inv")


def _rss_kib(field: str) -> int:
    """This process's ``VmRSS`` or ``VmHWM`` in KiB, by the library's reading of /proc."""
    from quotient_manifolds.adapters.memory import device_memory

    now = device_memory("cpu")
    if now is None:
        raise RuntimeError("the resident set is read from /proc/self/status (Linux only)")
    return {"VmRSS": now.in_use, "VmHWM": now.peak}[field] // 1024


def _address(t) -> int:
    """The storage address of a plain tensor; 0 for anything else (a collective's pending result
    has no storage yet)."""
    try:
        return t.untyped_storage().data_ptr() if hasattr(t, "untyped_storage") else 0
    except RuntimeError:
        return 0


class LiveTensorBytes:
    """Peak bytes of the tensors torch ops create while active whose Python objects live, each
    counted until it and every view of it are freed (a TorchDispatchMode): the solver's buffers
    exactly, on any device, but not what only C++ holds (autograd's saved activations, ``.grad``);
    printed as ``tensors`` beside the RSS."""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                given = {_address(t) for t in tree_flatten((args, kwargs))[0]}
                for t in tree_flatten(out)[0]:
                    address = _address(t)
                    if address and t._base is None and t.numel() and address not in given:
                        n = t.untyped_storage().nbytes()
                        tracker.live += n
                        tracker.peak = max(tracker.peak, tracker.live)
                        weakref.finalize(t, tracker.free, n)
                return out

        self.mode, self.live, self.peak = Mode(), 0, 0

    def free(self, n: int) -> None:
        self.live -= n


def build(layers: int, hidden: int, dtype, device: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    heads = max(hidden // 64, 1)
    # Qwen2.5-3B's proportions (MLP 5.375 × hidden, 8 query heads per key-value head): the
    # attention weights, which the geodesic geometries hold more for, are 11 % of the weights,
    # as in the 3B (11 %) and 7B (11 %) decoders
    config = transformers.Qwen2Config(
        vocab_size=8192, hidden_size=hidden, intermediate_size=int(5.375 * hidden),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 8, 1),
        tie_word_embeddings=True, max_position_embeddings=4096)
    model = transformers.Qwen2ForCausalLM(config).to(dtype=dtype, device=device).eval()
    return model


def measure(method, dtype_name, args, queue):
    import torch

    from quotient_manifolds import adapters

    torch.set_num_threads(args.threads)
    try:
        from quotient_manifolds.adapters import solver
        solver.KEEP_WORST_GRADIENT = method.endswith(" kept") if method != "fwd+bwd" else None
        solver.COMPACT_STEP = not args.full_step
    except (ImportError, AttributeError):
        pass
    method = method.split(" ")[0]
    dtype = getattr(torch, dtype_name)
    model = build(args.layers, args.hidden, dtype, args.device)
    n = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=g).to(args.device)
    batch = {"input_ids": ids, "labels": ids}
    if method == "fwd+bwd":
        model = model.float()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak RSS to the current RSS
    tracker = LiveTensorBytes()
    with tracker.mode:
        if method == "fwd+bwd":
            loss = adapters.next_token_loss(model(input_ids=ids), ids)
            loss.backward()
            del loss
        else:
            adapters.sharpness(model, [batch], geometry=method, rho=0.01, n_iters=args.iters,
                               loss_fn=adapters.next_token_loss, check_retraction=False)
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss_kib("VmHWM") * 1024) - base
    queue.put({"peak": peak, "tensors": tracker.peak, "params": n})


def run_one(*a):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(*a, queue))
    proc.start()
    got = queue.get()
    proc.join()
    return got


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full-step", action="store_true",
                        help="store the solver's last step in float32 (the layout before)")
    args = parser.parse_args(argv)
    print(f"{'dtype':9s} {'method':17s} {'params':>11s} {'RSS MiB':>8s} {'bytes/param':>11s} "
          f"{'tensors MiB':>11s} {'tensors B/p':>11s}")
    for dtype in args.dtypes:
        base = run_one("fwd+bwd", dtype, args)
        n = base["params"]
        activations = base["peak"]
        print(f"{dtype:9s} {'fwd+bwd fp32':17s} {n:11,d} {base['peak'] / 2**20:8.1f} "
              f"{'A=' + format(activations / 2**20, '.0f') + 'MiB':>11s}", flush=True)
        for method in (f"{m} {keep}" for m in METHODS[1:] for keep in ("lean", "kept")):
            got = run_one(method, dtype, args)
            print(f"{dtype:9s} {method:17s} {n:11,d} {got['peak'] / 2**20:8.1f} "
                  f"{(got['peak'] - activations) / n:11.1f} {got['tensors'] / 2**20:11.1f} "
                  f"{got['tensors'] / n:11.1f}", flush=True)
    print(f"settings: {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} tokens, "
          f"{args.iters} iterations, device {args.device}, last step in "
          f"{'float32' if args.full_step else 'bfloat16'}, python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
