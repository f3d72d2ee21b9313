"""One sharpness run, local or sharded: a decoder with rotary embeddings and grouped-query attention,
sharded with FSDP2 over 2 and 3 processes (gloo, CPU, float64), measured with **no layout=**: the
sharded model's layout is detected and verified on the shards (module by module), and every value
equals the one-call value of the unsharded model to 1e-10 (adaptive, geodesic-inv, geodesic-mix;
the retraction check's gap; ``calibrate_rho``; a two-radius ``sharpness_sweep``); the weights are
bit-identical afterwards and no ``.grad`` is left.

The heads straddle the shard cuts: 3 query heads of 4 rows share 1 key/value head; FSDP2 cuts
W_Q's 12 rows at 6 (2 ranks: inside head 1) and W_K's 4 rows at 2 (2 ranks) and at 2, 4 (3 ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from test_distributed import _free_port

RHO = {"adaptive": 0.05, "geodesic-inv": 0.05, "geodesic-mix": 0.02}
OPTIONS = dict(n_iters=3, retraction_tolerance=1e9)   # the gap is compared, not warned about

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_fsdp_one_run import measure_sharded
    dist.init_process_group("gloo", init_method="env://")
    out = measure_sharded()
    with open(os.environ["OUT"], "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def build():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                                   num_key_value_heads=1, head_dim=4, intermediate_size=16,
                                   max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def batches():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (3, 6), generator=g)
    return [{"input_ids": ids, "labels": ids}]


def measure(model):
    """Every value the test compares, from the public entry points, with no layout=."""
    from quotient_manifolds import adapters

    out = {}
    for geometry, rho in RHO.items():
        res = adapters.sharpness(model, batches(), geometry=geometry, rho=rho, **OPTIONS)
        out[geometry] = {"value": res.value, "worst": res.worst_losses, "gaps": res.retraction_gaps,
                         "shares": res.gl_norm_shares, "attention": res.attention_norm_shares,
                         "world": res.options["world_size"]}
    cal = adapters.calibrate_rho(model, batches(), geometry="geodesic-inv", target_loss_rise=0.02,
                                 max_evals=3, **OPTIONS)
    out["calibration"] = [cal.rho, *(v for evaluation in cal.evals for v in evaluation)]
    sweep = adapters.sharpness_sweep(model, batches(), [0.02, 0.05], geometry="geodesic-mix", **OPTIONS)
    out["sweep"] = [r.value for r in sweep]
    return out


def measure_sharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    out = measure(model)
    out["unchanged"] = all(torch.equal(p.full_tensor(), before[n]) and p.grad is None
                           for n, p in model.named_parameters())
    return out


def _run(world, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(__file__)))
    port = str(_free_port())
    return [subprocess.Popen([sys.executable, str(script)], env=dict(
        os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        OUT=str(tmp_path / f"one{world}_{rank}.json"), OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(world)]


def _collect(world, procs, tmp_path):
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-4000:]
    return [json.loads((tmp_path / f"one{world}_{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_run_without_a_layout_equals_the_one_call_value(world, tmp_path):
    procs = _run(world, tmp_path)
    local = measure(build())
    ranks = _collect(world, procs, tmp_path)
    for out in ranks:
        assert out.pop("unchanged")
        assert out == ranks[0]                      # every rank returns the same results
    got = ranks[0]
    for geometry in RHO:
        g, w = got[geometry], local[geometry]
        assert w["world"] == 1 and g["world"] == world
        for key in ("value", "worst", "gaps", "shares", "attention"):
            assert g[key] == pytest.approx(w[key], rel=1e-10, abs=1e-13), (geometry, key)
        assert len(g["gaps"]) == (0 if geometry == "adaptive" else 1)   # the check ran on both
        assert len(g["attention"]) == 1                                 # the same fields on both
    assert got["calibration"] == pytest.approx(local["calibration"], rel=1e-10)
    assert got["sweep"] == pytest.approx(local["sweep"], rel=1e-10)
    assert local["sweep"][0] <= local["sweep"][1]
