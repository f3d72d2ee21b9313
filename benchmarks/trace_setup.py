"""Follow ``model`` through one ``adapters.sharpness(..., geometry="geodesic-inv")`` call and count
the library modules it passes through: a *stop* is a run of consecutive calls, inside one module of
``quotient_manifolds``, of functions that hold the model in a local variable; *modules* the distinct
modules stopped in; *returns* the stops in a module already stopped in before (stops − modules). The model families
(``adapters/families/*``) count as one module, the package detection asks.
One call that enters each module once, in one direction, has returns = 0.

Also prints the number of public names of ``quotient_manifolds.adapters`` and its largest module.

    python benchmarks/trace_setup.py            # a 2-layer BERT from config, float32, CPU
    python benchmarks/trace_setup.py --sharded  # the same model sharded with FSDP2 (a one-rank gloo world)
"""

from __future__ import annotations

import pathlib
import sys

import torch


def _model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, [({"input_ids": ids}, torch.tensor([0, 1]))]


def trace(model, batches):
    """(stops, modules, returns) of one geodesic-inv sharpness call (module docstring)."""
    from quotient_manifolds import adapters

    root = pathlib.Path(adapters.__file__).resolve().parent.parent
    package = pathlib.Path(sys.modules["quotient_manifolds"].__file__).resolve().parent.parent
    stops = []

    def module_of(filename):
        if filename.startswith("<"):           # code generated at run time (dataclass __init__)
            return None
        path = pathlib.Path(filename).resolve()
        if "site-packages" in path.parts or ".venv" in path.parts:  # a venv inside the checkout
            return None
        for base in (root, package):
            if base in path.parents:
                name = str(path.relative_to(base).with_suffix(""))
                # the families are one package of the detection: one module here
                return "adapters/families" if name.startswith("adapters/families/") else name
        return None

    def tracer(frame, event, arg):
        if event == "call":
            name = module_of(frame.f_code.co_filename)
            if name is not None and any(v is model for v in frame.f_locals.values()):
                if not stops or stops[-1] != name:
                    stops.append(name)
        return None

    sys.settrace(tracer)
    try:
        adapters.sharpness(model, batches, geometry="geodesic-inv", rho=0.05, n_iters=2)
    finally:
        sys.settrace(None)
    return stops, sorted(set(stops)), len(stops) - len(set(stops))


def _sharded(model):
    """``model`` sharded with FSDP2 per layer and at the root, in a one-rank gloo world (this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    import argparse

    from quotient_manifolds import adapters

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharded", action="store_true",
                        help="trace the model sharded with FSDP2 (a one-rank gloo world)")
    args = parser.parse_args()
    model, batches = _model()
    if args.sharded:
        model = _sharded(model)
    adapters.sharpness(model, batches, geometry="adaptive", rho=0.05, n_iters=1)   # imports, caches
    stops, modules, returns = trace(model, batches)
    print(f"stops {len(stops)}, modules {len(modules)}, returns {returns}")
    print("  " + " -> ".join(stops))
    folder = pathlib.Path(adapters.__file__).parent
    sizes = sorted((len(p.read_text().splitlines()), str(p.relative_to(folder))) for p in folder.rglob("*.py"))
    print(f"public names of adapters: {len(adapters.__all__)} (__all__ with the optional Hessian names)")
    print(f"largest adapters module: {sizes[-1][1]} ({sizes[-1][0]} lines); over 600: "
          f"{[name for n, name in sizes if n > 600] or 'none'}")


if __name__ == "__main__":
    main()
