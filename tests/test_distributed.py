"""Batches spread over torch.distributed ranks (gloo, two CPU processes on loopback): the gathered
result equals the single-process run batch by batch, whatever the world size."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from quotient_manifolds.errors import UsageError

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_distributed import measure_both
    dist.init_process_group("gloo", init_method="env://")
    with open(os.environ["OUT"], "w") as fh:
        json.dump(measure_both(), fh)
    # No rank may tear down while another still talks to the store rank 0 hosts, and gloo's C++
    # threads must not meet interpreter finalisation: either can abort a worker at exit (SIGABRT,
    # "terminate called without an active exception"), as it once did in CI.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def build():
    import transformers

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).eval()


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 50, (2, 6), generator=g), torch.randint(0, 3, (2,), generator=g))
            for _ in range(5)]


def measure_both():
    """Both measures of the distributed run, on the process group of this process."""
    from quotient_manifolds import adapters

    out = {}
    for measure in ("worst", "average"):
        res = adapters.distributed_sharpness(build(), batches(), geometry="geodesic-mix", rho=0.05,
                                             n_iters=3, measure=measure, n_samples=3, seed=7)
        out[measure] = {"value": res.value, "per_batch": res.per_batch,
                        "world": res.options["world_size"]}
    return out


def _one_rank_here():
    """The world of one rank in this process (an in-memory store, no port), torn down after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return measure_both()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(__file__)))
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OUT=str(tmp_path / f"out{world}_{rank}.json"),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _results(world: int, procs, tmp_path):
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-3000:]
    return [json.loads((tmp_path / f"out{world}_{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
def test_two_ranks_equal_one_rank_and_plain_sharpness(tmp_path):
    from quotient_manifolds import adapters

    procs = _run(2, tmp_path)   # the two ranks start; the one-rank world runs here meanwhile
    one = _one_rank_here()
    two = _results(2, procs, tmp_path)
    assert two[0] == two[1]                                   # every rank returns the same result
    for measure in ("worst", "average"):
        assert two[0][measure]["world"] == 2
        assert two[0][measure]["per_batch"] == pytest.approx(one[measure]["per_batch"], abs=1e-6)
        assert two[0][measure]["value"] == pytest.approx(one[measure]["value"], abs=1e-6)
    model = build()
    plain = [adapters.sharpness(model, [b], geometry="geodesic-mix", rho=0.05, n_iters=3,
                                seed=7 + i).value for i, b in enumerate(batches())]
    assert one["worst"]["per_batch"] == pytest.approx(plain, abs=1e-6)


def test_needs_an_initialised_process_group():
    from quotient_manifolds import adapters

    with pytest.raises(UsageError, match="init_process_group"):
        adapters.distributed_sharpness(build(), batches(), rho=0.05)
