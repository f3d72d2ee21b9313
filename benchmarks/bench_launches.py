"""Operations, host reads and (on a GPU) kernel launches and syncs per Auto-PGD iteration.

On an accelerator the sharpness engine is bound by host work where the GPU's share is small: every
operation costs the host a dispatch (and a kernel launch), and every read of a tensor's value on
the host waits until the GPU has run everything queued before it, so the GPU idles while the host
queues what comes next. This benchmark watches one iteration (the third) of each method on one
batch and prints:

- the operations dispatched, views aside (a ``TorchDispatchMode``), and the lines of the library
  or of the model's code that issued the most of them;
- the host reads of tensor values (``item``, ``tolist``, ``float()``, ``int()``, ``bool()``) and
  where they are made: each is a sync on an accelerator;
- with ``--device cuda``: the syncs torch reports (``torch.cuda.set_sync_debug_mode``) and the
  kernel launches (``torch.profiler``), and the iteration's wall time.

On the CPU the components are cut and the products taken as on an accelerator
(``--as-on-cpu`` keeps the CPU's choices), so the counts are those a GPU run dispatches, except the
CPU's piecewise elementwise passes (``elementwise.py``), which a GPU runs as one kernel per tensor.

    python benchmarks/bench_launches.py [--models bert-base] [--methods adaptive geodesic-mix]
                                        [--batch 2] [--seq 8] [--device cpu|cuda] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: operations that launch nothing (views, metadata, allocations)
VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "narrow", "slice", "select",
    "expand", "permute", "as_strided", "detach", "unsqueeze", "squeeze", "split", "split_with_sizes",
    "unbind", "alias", "empty", "empty_strided", "empty_like", "unflatten", "flatten", "mT",
    "resolve_conj", "resolve_neg", "lift_fresh", "is_same_size", "diagonal", "_to_copy_noop",
    "view_as_real", "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_contiguous", "size", "stride", "dim"})
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _site(skip: int = 2) -> str:
    """The innermost frame of the library (or of a model's code) that made the current call."""
    for frame in reversed(traceback.extract_stack()[:-skip]):
        name = frame.filename
        if ((name.startswith(ROOT) and "site-packages" not in name and not name.startswith(HERE))
                or "transformers/models" in name):
            return f"{os.path.relpath(name, ROOT) if name.startswith(ROOT) else os.path.basename(name)}:{frame.lineno}"
    return "(torch internals, autograd)"


def watch(model_name: str, method: str, size: int, seq: int, device: str, top: int, as_on_cpu: bool):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, HERE)
    from bench_sharpness import batch, build
    from quotient_manifolds import adapters
    from quotient_manifolds.adapters import ball as ball_module
    from quotient_manifolds.core import products

    if device == "cpu" and not as_on_cpu:   # what an accelerator runs: its components, torch's products
        ball_module.CPU_COMPONENT_BYTES = ball_module.ACCELERATOR_COMPONENT_BYTES
        products.NUMPY_ON_CPU = False
    cuda = device.startswith("cuda")
    model = build(model_name, device)
    inputs, targets = batch(model, size, seq, device)

    class Operations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sites = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in VIEWS:
                self.sites[(func.__name__.split(".")[0], _site())] += 1
            return func(*args, **(kwargs or {}))

    reads = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def read(self, *args, **kwargs):
            if watching["on"]:
                reads[(name, _site())] += 1
            return originals[name](self, *args, **kwargs)
        return read

    watching = {"on": False, "k": 0}
    ops = Operations()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if cuda else None
    caught = []

    def on_iteration(*_):
        watching["k"] += 1
        if cuda:
            torch.cuda.synchronize()
        if watching["k"] == 2:
            watching["t"] = time.perf_counter()
            if cuda:
                profiler.__enter__()
                torch.cuda.set_sync_debug_mode("warn")
            ops.__enter__()
            watching["on"] = True
        elif watching["k"] == 3:
            watching["on"] = False
            ops.__exit__(None, None, None)
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
                profiler.__exit__(None, None, None)
            watching["t"] = time.perf_counter() - watching["t"]

    engine = importlib.import_module("quotient_manifolds.adapters.worst_case")
    solver_run = engine.auto_pgd

    def with_hook(*args, **kwargs):
        kwargs["on_iteration"] = on_iteration
        return solver_run(*args, **kwargs)

    engine.auto_pgd = with_hook
    for name in HOST_READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            adapters.sharpness(model, [(inputs, targets)], geometry=method, rho=0.05, n_iters=5,
                               check_retraction=False)
    finally:
        engine.auto_pgd = solver_run
        for name, method_ in originals.items():
            setattr(torch.Tensor, name, method_)
    total = sum(ops.sites.values())
    print(f"{model_name} {method}: one iteration, {watching['t']:.4f} s wall (watched), "
          f"{total} operations, {sum(reads.values())} host reads")
    if cuda:
        syncs = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
                                    if "synchroniz" in str(w.message))
        launches = sum(e.count for e in profiler.key_averages()
                       if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                    "cuLaunchKernelEx"))
        print(f"  kernel launches {launches}; syncs torch reported {sum(syncs.values())}: "
              f"{dict(syncs.most_common(8))}")
    print(f"  host reads: {dict(reads.most_common(8))}")
    print("  operations by site:")
    for (op, site), count in ops.sites.most_common(top):
        print(f"    {count:6d} {op:28s} {site}")
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert-base"])
    parser.add_argument("--methods", nargs="+", default=["adaptive", "geodesic-mix", "geodesic-inv"],
                        choices=("adaptive", "geodesic-mix", "geodesic-inv"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8, help="tokens per sequence")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=15, help="sites listed per method")
    parser.add_argument("--as-on-cpu", action="store_true",
                        help="on the CPU, keep the CPU's components and products")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    for model_name in args.models:
        for method in args.methods:
            watch(model_name, method, args.batch, args.seq, args.device, args.top, args.as_on_cpu)


if __name__ == "__main__":
    main()
