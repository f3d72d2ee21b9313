"""Sharpness of a model sharded with FSDP2 (``fully_shard`` on a CPU device mesh, gloo, 2 and 3
processes, float64): the value, the worst-point loss and the attention share equal those of the
unsharded model, also with data parallelism combined (each rank its half of the batch); the
model's weights and gradients are left as they were. The heads straddle shard boundaries: 7 heads
of 2 over 14 rows cut at 7 (2 ranks) and at 5 and 10 (3 ranks). The GL blocks are divided among
the ranks: each block is held by exactly one, and every rank holds some. The solver's memory
decision (keep the worst point's gradient or recompute it) is the same on every rank."""

from __future__ import annotations


import pytest
import torch

from gloo_ranks import collect, launch
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, NotSupported

GEOMETRIES = ("adaptive", "geodesic-inv", "geodesic-mix")
RHO = {"adaptive": 0.05, "geodesic-inv": 0.05, "geodesic-mix": 0.01}

def build():
    import transformers

    cfg = transformers.BertConfig(vocab_size=30, hidden_size=14, num_hidden_layers=2,
                                  num_attention_heads=7, intermediate_size=16, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).double().eval()


def batch(rows=slice(None)):
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 30, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)
    return ids[rows], labels[rows]


def _measure(model, batches, layout, geometries=GEOMETRIES):
    from quotient_manifolds import adapters

    out = {}
    for geometry in geometries:
        res = adapters.sharpness(model, batches, geometry=geometry, rho=RHO[geometry], n_iters=3,
                                 check_retraction=False,
                                 layout=None if geometry == "adaptive" else layout)
        out[geometry] = {"value": res.value, "worst": res.worst_losses,
                         "share": res.gl_norm_shares}
    return out


def measure_sharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters
    from quotient_manifolds.adapters import memory, placement, sharded, solver
    from quotient_manifolds.adapters.components import ProductBall

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    held = set()                              # the GL blocks this rank builds frames for
    build_components = placement.quotient_components

    def recorded(blocks, *args, **kwargs):
        held.update(b.name for b in blocks)
        return build_components(blocks, *args, **kwargs)

    placement.quotient_components = recorded
    # a vote of the ranks: every rank learns that one of them said no
    vote = ProductBall([sharded.ShardedElementwise({"w": torch.ones(2, dtype=torch.float64)})])
    votes = [vote.on_every_rank(rank == 0), vote.on_every_rank(True)]
    if rank == 1:  # this rank alone has no room for the worst point's gradient: every rank then
        # recomputes it at restarts (one rank alone taking passes the others do not would hang)
        solver.device_memory = lambda device: memory.DeviceMemory(available=0, total=1, in_use=0,
                                                                  peak=0)
    model = build()
    layout = adapters.layout(model)
    layout.verify(model, batch()[0])          # verified before sharding
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    same = _measure(model, [batch()], layout, GEOMETRIES if world == 2 else ("geodesic-inv",))
    half = len(batch()[0]) // 2
    mine = slice(0, half) if rank == 0 else slice(half, None)
    split = _measure(model, [batch(mine)], layout, ("geodesic-mix",)) if world == 2 else None
    unchanged = all(torch.equal(p.full_tensor(), before[n]) and p.grad is None
                    for n, p in model.named_parameters())
    return {"same": same, "split": split, "unchanged": unchanged, "held": sorted(held),
            "blocks": layout.block_names, "votes": votes}


def _assert_equal(got, want):
    assert set(got) == set(want)
    for geometry in got:
        g, w = got[geometry], want[geometry]
        assert g["value"] == pytest.approx(w["value"], rel=1e-10), geometry
        assert g["worst"] == pytest.approx(w["worst"], rel=1e-10), geometry
        assert g["share"] == pytest.approx(w["share"], rel=1e-10), geometry


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_sharded_sharpness_equals_the_unsharded_model(world, tmp_path):
    from quotient_manifolds import adapters

    procs = launch(world, tmp_path, "test_fsdp", "measure_sharded")
    model = build()
    layout = adapters.layout(model)
    layout.verify(model, batch()[0])
    plain = _measure(model, [batch()], layout, GEOMETRIES if world == 2 else ("geodesic-inv",))
    ranks = collect(procs, tmp_path, "measure_sharded")
    held = [set(out["held"]) for out in ranks]
    assert all(held), held                            # 4 blocks (QK, VO per layer): each rank some
    assert sum(map(len, held)) == len(set().union(*held)) == len(ranks[0]["blocks"])
    for out in ranks:
        assert out["unchanged"] and out["votes"] == [False, True]
        assert out["same"] == ranks[0]["same"]        # every rank returns the same result
        _assert_equal(out["same"], plain)
        if world == 2:                                # data parallelism: each rank half the batch
            _assert_equal(out["split"], {"geodesic-mix": plain["geodesic-mix"]})


def test_sharded_refusals_name_the_option_before_any_work():
    """What the sharded placement cannot do is refused before any forward pass, naming the option
    or the entry point and what to do instead (a one-rank world here); the weights are left as they
    were."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        calls = []
        model.register_forward_pre_hook(lambda module, args: calls.append(1))
        with pytest.raises(InvalidArgument, match="include_frozen=True on a model sharded with FSDP2"):
            adapters.sharpness(model, [batch()], geometry="geodesic-inv", rho=0.05, include_frozen=True)
        with pytest.raises(InvalidArgument, match="Call adapters.sharpness.*on every rank"):
            adapters.distributed_sharpness(model, [batch()], geometry="adaptive", rho=0.05)
        with pytest.raises(NotSupported, match="riemannian_hessian on a model sharded with FSDP2"):
            adapters.riemannian_hessian(model, [batch()], geometry="geodesic-inv")
        assert not calls
        assert all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    finally:
        dist.destroy_process_group()


def test_half_precision_shards_are_refused_where_fsdp2_cannot_compute_them_in_float32(monkeypatch):
    """Where this torch's FSDP2 keeps its mixed-precision state elsewhere than the run expects, a
    model computing in half precision is refused before any forward pass (not measured in bfloat16,
    where the perturbations round away); the weights stay as they were."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters
    from quotient_manifolds.adapters import sharded

    monkeypatch.setattr(sharded, "_float32_supported", lambda pairs: False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build().to(torch.bfloat16)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        calls = []
        model.register_forward_pre_hook(lambda module, args: calls.append(1))
        with pytest.raises(InvalidArgumentType, match="computes in half precision .*shards are torch.bfloat16"):
            adapters.sharpness(model, [batch()], geometry="adaptive", rho=0.05, n_iters=2)
        assert not calls
        assert all(torch.equal(p.full_tensor(), before[n]) and p.dtype == torch.bfloat16
                   for n, p in model.named_parameters())
    finally:
        dist.destroy_process_group()


def test_layout_verify_on_a_sharded_model_gives_the_unsharded_verdict():
    """Layout.verify on a sharded decoder (rotary, grouped-query) checks each attention module alone
    on its shards: the detected layout passes, and a layout whose query/key blocks claim the full
    GL(h) (not a symmetry under the rotary map) fails on the same blocks as on the unsharded model,
    raising SymmetryError by default; the weights are left as they were."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters
    from quotient_manifolds.core.groups import GLGroup
    from test_fsdp_one_run import batches as decoder_batches, build as decoder

    def wrong(layout):
        return dataclasses.replace(layout, blocks=[dataclasses.replace(b, group=GLGroup()) if b.kind == "qk"
                                                   else b for b in layout.blocks])

    inputs = {"input_ids": decoder_batches()[0]["input_ids"]}
    plain = decoder()
    want = wrong(adapters.layout(plain)).verify(plain, inputs, raise_on_failure=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = decoder()
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        layout = adapters.layout(model)
        report = layout.verify(model, inputs)
        assert report.passed and not layout.verify_failed
        broken = wrong(layout)
        got = broken.verify(model, inputs, raise_on_failure=False)
        assert not got.passed and sorted(got.failing) == sorted(want.failing)
        assert {name.rsplit("/", 1)[-1] for name in got.failing} <= {"qk"} and got.failing
        assert broken.verify_failed == got.failing
        with pytest.raises(adapters.SymmetryError, match="module by module on the shards"):
            broken.verify(model, inputs)
        assert all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    finally:
        dist.destroy_process_group()


def test_average_case_and_progress_on_one_rank_equal_the_unsharded_run(capsys):
    """measure="average" draws each rank's shards from seed·world + rank: on one rank that is the
    unsharded run's generator, so the value is the same to 1e-10; progress=True shows a bar (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters

    kw = dict(geometry="geodesic-inv", rho=0.05, measure="average", n_samples=3, seed=7)
    want = adapters.sharpness(build(), [batch()], **kw)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        got = adapters.sharpness(model, [batch()], progress=True, **kw)
    finally:
        dist.destroy_process_group()
    assert got.value == pytest.approx(want.value, rel=1e-10) and got.value != 0
    assert got.per_batch == pytest.approx(want.per_batch, rel=1e-10)
    assert "geodesic-inv sharpness" in capsys.readouterr().err


def test_an_attention_module_that_is_an_fsdp_unit_is_refused_with_what_to_shard_instead():
    """A block is checked on a copy of its module alone, which an FSDP2 unit's hooks do not allow:
    refused naming the module and the layers to shard instead."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build()
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model.bert.encoder.layer[0].attention, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(NotSupported, match="bert.encoder.layer.0.attention.*itself an FSDP2 unit"):
            adapters.sharpness(model, [batch()], geometry="geodesic-inv", rho=0.05, n_iters=2)
        res = adapters.sharpness(model, [batch()], geometry="adaptive", rho=0.05, n_iters=2)
        assert res.value > 0
    finally:
        dist.destroy_process_group()


def test_owners_keep_blocks_that_share_a_weight_together_and_balance_the_rest():
    """Blocks sharing a weight (a fused QKV written by the QK and VO blocks) go to one rank; the
    groups, largest first, each to the least loaded rank; the same answer for the same input."""
    from types import SimpleNamespace

    from quotient_manifolds.adapters.sharded import assign_owners

    def block(*params):
        return SimpleNamespace(params=params)

    blocks = [block("l0.qkv", "l0.o"), block("l0.qkv"),        # one group through l0.qkv: 40
              block("l1.q", "l1.k"), block("l1.v", "l1.o"),    # 20 and 20
              block("l2.q", "l2.k")]                           # 10
    sizes = {"l0.qkv": 30, "l0.o": 10, "l1.q": 10, "l1.k": 10, "l1.v": 10, "l1.o": 10,
             "l2.q": 5, "l2.k": 5}
    owners = assign_owners(blocks, sizes, 2)
    assert owners == assign_owners(list(blocks), dict(sizes), 2)
    assert set(owners) == set(sizes)
    assert owners["l0.qkv"] == owners["l0.o"] == 0                 # the largest group first
    assert owners["l1.q"] == owners["l1.k"] == owners["l1.v"] == owners["l1.o"] == 1  # 20, then 20
    assert owners["l2.q"] == owners["l2.k"] == 0                   # loads 40 and 40: the lowest rank
    load = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(2)]
    assert load == [50, 40]
    assert set(assign_owners(blocks, sizes, 8).values()) == {0, 1, 2, 3}   # 4 groups, 8 ranks
