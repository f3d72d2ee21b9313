"""Memory per rank of sharpness of an FSDP2-sharded model, against the number of ranks.

A Qwen2-shaped decoder from config (float32, random weights; ``--layers``/``--hidden``) is sharded
with ``fully_shard`` (each decoder layer, then the root) over W CPU processes (gloo) for each W of
``--worlds``; every rank measures ``adapters.sharpness`` on the same batch. Printed per W and
geometry: the largest per-rank peak of the bytes of live tensors created during the run (every
tensor counted until it and its views are freed: FSDP2's gathered weights, the gradients, the
solver's vectors, activations), in MiB and in bytes per parameter of the whole model, and the
ratio to W = 1.
FSDP2's lazy initialisation (a first forward and backward) runs before anything is measured.
What falls as 1/W: the solver's vectors and the trained-weight copy of the elementwise weights,
and the attention blocks (each held by one rank); what does not: the activations, one gathered
layer of weights at a time, and one attention weight at a time gathered whole on every rank.

    python benchmarks/bench_fsdp_memory.py [--worlds 1 2 4] [--layers 8] [--hidden 512]
                                           [--geometries adaptive geodesic-inv]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch.multiprocessing as mp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _rank(rank, world, port, args, queue):
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    heads = max(args.hidden // 64, 1)
    config = transformers.Qwen2Config(
        vocab_size=8192, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
        tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).eval()
    n = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    out = {}
    for geometry in args.geometries:
        layout = None
        if geometry != "adaptive":
            layout = adapters.layout(model)
            layout.verify(model, {"input_ids": ids[:1]})
        out[geometry] = layout
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # FSDP2's lazy initialisation (its first forward) is not the sharpness run's: done untracked
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    peaks = {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_memory import LiveTensorBytes

    for geometry, layout in out.items():
        tracker = LiveTensorBytes()
        with tracker.mode:
            adapters.sharpness(model, [batch], geometry=geometry, rho=0.05, n_iters=args.iters,
                               layout=layout, loss_fn=adapters.next_token_loss, check_retraction=False,
                               keep_worst_gradient=False)
        peaks[geometry] = tracker.peak
    queue.put((rank, n, peaks))
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--geometries", nargs="+", default=["adaptive", "geodesic-inv"])
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    first = {}
    print(f"{'world':>5s} {'geometry':13s} {'max rank peak MiB':>18s} {'bytes/param':>12s} {'vs world 1':>10s}")
    for world in args.worlds:
        queue = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got = [queue.get() for _ in procs]
        for p in procs:
            p.join()
        n = got[0][1]
        for geometry in args.geometries:
            peak = max(peaks[geometry] for _, _, peaks in got)
            first.setdefault(geometry, peak)
            print(f"{world:5d} {geometry:13s} {peak / 2**20:18.1f} {peak / n:12.2f} "
                  f"{peak / first[geometry]:10.2f}", flush=True)
    print(f"settings: {args.layers} layers, hidden {args.hidden} ({n:,} parameters, float32), batch "
          f"{args.batch} x {args.seq} tokens, {args.iters} iterations, gloo on CPU, python "
          f"{sys.version.split()[0]}")


if __name__ == "__main__":
    main()
