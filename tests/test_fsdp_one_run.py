"""One sharpness run, local or sharded: a decoder with rotary embeddings and grouped-query attention,
sharded with FSDP2 over 2 and 3 processes (gloo, CPU, float64), measured with **no layout=**: the
sharded model's layout is detected and verified on the shards (module by module), and every value
equals the one-call value of the unsharded model to 1e-10 (adaptive, geodesic-inv, geodesic-mix;
the retraction check's gap; ``calibrate_rho``; a two-radius ``sharpness_sweep``; the exact
retraction); the weights are
bit-identical afterwards and no ``.grad`` is left. The same holds, to 1e-6, for bfloat16 shards and
for float32 shards computed in bfloat16 by FSDP2's MixedPrecisionPolicy: both are evaluated in
float32 at their weights, as the unsharded bfloat16 model is, and compute in bfloat16 again after.

The heads straddle the shard cuts: 3 query heads of 4 rows share 1 key/value head; FSDP2 cuts
W_Q's 12 rows at 6 (2 ranks: inside head 1) and W_K's 4 rows at 2 (2 ranks) and at 2, 4 (3 ranks)."""

from __future__ import annotations

import os

import pytest
import torch

from gloo_ranks import collect, launch

RHO = {"adaptive": 0.05, "geodesic-inv": 0.05, "geodesic-mix": 0.02}
OPTIONS = dict(n_iters=2, retraction_tolerance=1e9)   # the gap is compared, not warned about

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


def measure(model, compact: bool = True):
    """Every value the test compares, from the public entry points, with no layout= (and the
    compact solver's value when ``compact``)."""
    from quotient_manifolds import adapters

    out = {}
    for geometry, rho in RHO.items():
        res = adapters.sharpness(model, batches(), geometry=geometry, rho=rho, **OPTIONS)
        out[geometry] = {"value": res.value, "worst": res.worst_losses, "gaps": res.retraction_gaps,
                         "shares": res.gl_norm_shares, "attention": res.attention_norm_shares,
                         "world": res.options["world_size"]}
    cal = adapters.calibrate_rho(model, batches(), geometry="geodesic-inv", target_loss_rise=0.02,
                                 max_evals=2, **OPTIONS)
    out["calibration"] = [cal.rho, *(v for evaluation in cal.evals for v in evaluation)]
    sweep = adapters.sharpness_sweep(model, batches(), [0.02, 0.05], geometry="geodesic-mix", **OPTIONS)
    out["sweep"] = [r.value for r in sweep]
    out["exact"] = adapters.sharpness(model, batches(), geometry="geodesic-inv", rho=0.05, retraction="exact",
                                      **OPTIONS).value
    if not compact:
        return out
    # the compact solver on both placements (geodesic-inv: its elementwise and its GL blocks)
    out["compact"] = adapters.sharpness(model, batches(), geometry="geodesic-inv", rho=RHO["geodesic-inv"],
                                        solver_dtype=torch.bfloat16, **OPTIONS).value
    return out


def measure_half(model):
    """Adaptive and geodesic-inv values of a model that computes in bfloat16 (measured in float32)."""
    from quotient_manifolds import adapters

    return [adapters.sharpness(model, batches(), geometry=geometry, rho=RHO[geometry], n_iters=2).value
            for geometry in ("adaptive", "geodesic-inv")]


def shard(model, **policy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def unchanged(model, before):
    """The weights bit for bit, in their dtype, and no .grad left."""
    return all(torch.equal(p.full_tensor(), before[n]) and p.dtype == before[n].dtype and p.grad is None
               for n, p in model.named_parameters())


def measure_sharded():
    """On a rank: with ``WHAT=float`` the float64 model's values; with ``WHAT=half`` those of
    bfloat16 shards and of float32 shards computed in bfloat16 by FSDP2's MixedPrecisionPolicy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    what = os.environ["WHAT"]
    if what == "float":
        model = shard(build())
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        # the compact solver on 2 ranks (3 ranks' uneven shards are the float32 solver's question)
        out = measure(model, compact=torch.distributed.get_world_size() == 2)
        out["unchanged"] = unchanged(model, before)
        return out
    halves = {"bf16": shard(build().to(torch.bfloat16)),
              "policy": shard(build().to(torch.bfloat16).float(),
                              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))}
    kept = {name: {n: p.full_tensor().clone() for n, p in m.named_parameters()} for name, m in halves.items()}
    out = {name: measure_half(m) for name, m in halves.items()}
    out["unchanged"] = all(unchanged(m, kept[name]) for name, m in halves.items())
    out["computes_in"] = [str(m(**batches()[0]).logits.dtype) for m in halves.values()]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_run_without_a_layout_equals_the_one_call_value(world, tmp_path):
    procs = launch(world, tmp_path, "test_fsdp_one_run", "measure_sharded", WHAT="float")
    local = measure(build())
    ranks = collect(procs, tmp_path, "measure_sharded")
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
    assert got["exact"] == pytest.approx(local["exact"], rel=1e-10)   # the exact geodesic on the owners
    # the compact solver's bfloat16 roundings are not bit-identical across placements (measured:
    # 1.7e-4 relative on adaptive); they agree within its bound against the float32 solver
    if world == 2:
        assert got["compact"] == pytest.approx(local["compact"], rel=1e-2)
        assert got["compact"] != got["geodesic-inv"]["value"]
    else:
        assert "compact" not in got
    assert local["sweep"][0] <= local["sweep"][1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])   # uneven shards (3 ranks) are the float test's: this one is about dtypes
def test_half_precision_shards_are_measured_in_float32_as_the_unsharded_model(world, tmp_path):
    procs = launch(world, tmp_path, "test_fsdp_one_run", "measure_sharded", WHAT="half")
    half = measure_half(build().to(torch.bfloat16))   # evaluated in float32 at the bfloat16 weights
    ranks = collect(procs, tmp_path, "measure_sharded")
    for out in ranks:
        assert out.pop("unchanged")
        assert out == ranks[0]
    for name in ("bf16", "policy"):   # the local path's rule: the same weights in float32
        assert ranks[0][name] == pytest.approx(half, rel=1e-6), name
    assert ranks[0]["computes_in"] == ["torch.bfloat16"] * 2   # the model's own precision afterwards
