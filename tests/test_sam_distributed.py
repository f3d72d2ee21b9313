"""GeodesicSAM under DistributedDataParallel and FSDP2 (gloo, CPU processes forked from the test,
float64): one step equals the single-process step on the same global batch, for every geometry, on
tiny attention models whose heads straddle the shard boundaries (3 heads of 4 rows: 12 rows over 2
ranks cut head 1 in two, and the output projection's head columns lie on every rank; GPT-2's fused
c_attn, whose heads are columns, is cut across every head); a non-finite gradient on one rank only
leaves every rank's model untouched; bfloat16 FSDP2 steps are finite."""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing
import os
import sys
import traceback

import pytest
import torch

from conftest import PlainViT
from test_distributed import _free_port

GEOMETRIES = ("geodesic-mix", "geodesic-inv", "adaptive", "sam")
#: the global batch: every world size splits it into equal parts, so the mean of the ranks' mean
#: losses is the single-process mean loss
BATCH = 12

# ------------------------------------------------------------------------------------ in the workers
def build(kind="vit"):
    """"vit": separate q/k/v/o Linear layers, a head's rows in one parameter; "gpt2": GPT-2's
    fused c_attn (Conv1D: heads are columns, so dim-0 shards cut every head; one parameter holds
    Q, K and V) and tied embeddings."""
    torch.manual_seed(0)
    if kind == "gpt2":
        import transformers

        cfg = transformers.GPT2Config(vocab_size=50, n_embd=12, n_layer=1, n_head=3, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).to(torch.float64).eval()
    return PlainViT(dim=12, num_heads=3, depth=1).to(torch.float64)


def layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.blocks


def global_batch(kind="vit"):
    g = torch.Generator().manual_seed(1)
    if kind == "gpt2":   # every sequence has the same length: the mean over tokens splits evenly
        ids = torch.randint(0, 50, (BATCH, 8), generator=g)
        return ids, ids
    return (torch.randn(BATCH, 1, 8, 8, dtype=torch.float64, generator=g),
            torch.randint(0, 3, (BATCH,), generator=g))


def whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(model):
    return {n: whole(p) for n, p in model.named_parameters()}


def loss_of(model, x, y):
    if not x.is_floating_point():   # token ids: the causal-LM loss
        return model(input_ids=x, labels=y).loss
    return torch.nn.functional.cross_entropy(model(x), y)


def one_step(model, x, y, geometry, *, wrapped=None, first_pass_unsynced=False):
    """(w_adv, w after the step, ‖g‖) of one GeodesicSAM step with SGD (momentum 0.9)."""
    from contextlib import nullcontext

    from quotient_manifolds.adapters import GeodesicSAM

    net = wrapped if wrapped is not None else model
    opt = GeodesicSAM(net, torch.optim.SGD, rho=0.1, geometry=geometry, lr=0.1, momentum=0.9)
    with net.no_sync() if first_pass_unsynced else nullcontext():
        loss_of(net, x, y).backward()
    opt.first_step(zero_grad=True)
    adv = snapshot(model)
    loss_of(net, x, y).backward()
    opt.second_step(zero_grad=True)
    return adv, snapshot(model), opt.grad_norm


def relative_difference(got, ref):
    """max over parameters of ‖got − ref‖_∞ / ‖ref‖_∞, over w_adv and the stepped weights."""
    return max(float((got[i][n] - ref[i][n]).abs().max() / ref[i][n].abs().max())
               for i in (0, 1) for n in ref[0])


def sharded(x, kind="vit"):
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds import adapters

    model = build(kind)
    inputs = x[:2] if x.is_floating_point() else {"input_ids": x[:2]}
    adapters.layout(model).verify(model, inputs)   # on the whole model, before sharding
    for block in layers(model):
        fully_shard(block)
    fully_shard(model)
    return model


def single_process_steps(kind="vit"):
    """geometry → the single-process step on the whole batch (the reference)."""
    x, y = global_batch(kind)
    return {geometry: one_step(build(kind), x, y, geometry) for geometry in GEOMETRIES}


def compare_on_ranks(modes, refs, kind="vit"):
    """Per mode ("ddp", "ddp-no-sync": the ascent pass inside no_sync(), "fsdp") and geometry: the
    max relative difference to the single-process step ``refs`` on this rank, and ‖g‖ (the same on
    every rank). With "fsdp-checks": the non-finite cases and the bfloat16 step under FSDP2; with
    "ddp-no-sync": a parameter without a gradient on one rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(kind)
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = {}
    for geometry in GEOMETRIES:
        ref = refs[geometry]
        for mode in (m for m in modes if m in ("ddp", "ddp-no-sync", "fsdp")):
            if mode == "fsdp":
                model = sharded(x, kind)
                got = one_step(model, x[part], y[part], geometry)
            else:
                model = build(kind)
                got = one_step(model, x[part], y[part], geometry, wrapped=DDP(model),
                               first_pass_unsynced=mode == "ddp-no-sync")
            out[f"{mode}/{geometry}"] = {"rel": relative_difference(got, ref), "norm": got[2],
                                         "norm_ref": ref[2]}
    if "fsdp-checks" in modes:
        out["non_finite"] = non_finite_cases(x[part], y[part], rank)
        out["bf16"] = bf16_step(x[part], y[part])
        out["refusals"] = refusals(x[part], y[part])
    if "ddp-no-sync" in modes:
        out["unused"] = unused_on_one_rank(x[part], y[part], rank)
    return out


def unused_on_one_rank(x, y, rank):
    """After a pass inside no_sync(): a parameter with no gradient on rank 0 only gets the average
    with 0 there (its .grad created); one with no gradient anywhere keeps .grad None."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from quotient_manifolds.adapters import GeodesicSAM

    model = build()
    ddp = DDP(model)
    opt = GeodesicSAM(ddp, torch.optim.SGD, rho=0.1, geometry="adaptive", lr=0.1)
    with ddp.no_sync():
        loss_of(ddp, x, y).backward()
    own = model.head.bias.grad.clone()
    model.pos.grad = None                       # on every rank
    if rank == 0:
        model.head.bias.grad = None             # on rank 0 only
    opt.first_step(zero_grad=False)
    gathered = [torch.empty_like(own) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.zeros_like(own) if rank == 0 else own)
    expected = torch.stack(gathered).mean(0)
    got = model.head.bias.grad
    opt.second_step(zero_grad=True)
    return {"averaged": got is not None and bool(torch.allclose(got, expected, rtol=0, atol=1e-15)),
            "none_kept": model.pos.grad is None}


def bf16_step(x, y):
    """FSDP2 in bfloat16 compute (MixedPrecisionPolicy: float32 shards, bfloat16 forward and
    backward, float32 reduction): every geometry's step is finite and moves the weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from quotient_manifolds import adapters
    from quotient_manifolds.adapters import GeodesicSAM

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for geometry in GEOMETRIES:
        model = build().float()
        adapters.layout(model).verify(model, x[:2].float())
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        before = snapshot(model)
        opt = GeodesicSAM(model, torch.optim.SGD, rho=0.1, geometry=geometry, lr=0.1)
        opt.step(lambda: loss_of(model, x.float(), y).backward())
        after = snapshot(model)
        out[geometry] = (all(bool(torch.isfinite(w).all()) for w in after.values())
                         and any(not torch.equal(after[n], before[n]) for n in before)
                         and math.isfinite(opt.grad_norm) and opt.grad_norm > 0)
    return out


def refusals(x, y):
    """What GeodesicSAM refuses on a sharded model, each with the message that says what to do, and
    a geodesic step on a model whose layout was never verified before sharding (verified on the
    shards at the first step)."""
    from torch.distributed.fsdp import fully_shard

    from quotient_manifolds.adapters import GeodesicSAM

    out = {}
    model = build()                 # sharded without verifying the layout on the whole model first
    for block in model.blocks:
        fully_shard(block)
    try:                            # the root left unsharded: its parameters are plain tensors
        GeodesicSAM(model, torch.optim.SGD, geometry="adaptive", lr=0.1)
    except ValueError as err:
        out["root"] = "fully_shard(model)" in str(err)
    fully_shard(model)
    # no layout verified before sharding: the first step verifies it on the shards, module by module
    opt = GeodesicSAM(model, torch.optim.SGD, geometry="geodesic-mix", lr=0.1)
    loss_of(model, x, y).backward()
    opt.first_step(zero_grad=True)
    loss_of(model, x, y).backward()
    opt.second_step(zero_grad=True)
    out["unverified"] = bool(opt.layout.blocks) and not opt.layout.verify_failed
    opt = GeodesicSAM(model, torch.optim.SGD, geometry="adaptive", lr=0.1)
    loss_of(model, x, y).backward()
    try:
        opt.first_step(scaler=torch.amp.GradScaler("cpu"))
    except ValueError as err:
        out["scaler"] = "bfloat16" in str(err)
    return out


def non_finite_cases(x, y, rank):
    """A NaN in the last rank's gradient shard only, at w (first_step) and at w_adv (second_step):
    every rank must refuse, and leave its model as it was (restored to w)."""
    import torch.distributed as dist

    from quotient_manifolds.adapters import GeodesicSAM

    last = rank == dist.get_world_size() - 1
    out = {}
    for where in ("first", "second"):
        model = sharded(torch.cat([x, x]))
        before = snapshot(model)
        opt = GeodesicSAM(model, torch.optim.SGD, rho=0.1, geometry="geodesic-mix", lr=0.1)
        loss_of(model, x, y).backward()
        poison = model.blocks[0].attn.q.weight.grad.to_local()
        if where == "first" and last:
            poison.view(-1)[0] = float("nan")
        try:
            opt.first_step(zero_grad=True)
            loss_of(model, x, y).backward()
            if where == "second" and last:
                model.blocks[0].attn.q.weight.grad.to_local().view(-1)[0] = float("nan")
            opt.second_step(zero_grad=True)
            out[where] = "stepped"
        except ValueError as err:
            out[where] = "refused" if "non-finite" in str(err) else str(err)
        after = snapshot(model)
        out[where + "_untouched"] = all(torch.equal(after[n], before[n]) for n in before)
    return out


# ------------------------------------------------------------------------------------ the tests
def _worker(rank, world, port, modes, refs, kind, out):
    """One rank, in a process forked from the test's (the imports are inherited: a fresh
    interpreter per rank would spend most of the test importing torch)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    code = 1
    try:
        # a rank that fails leaves the others waiting in a collective: not for gloo's 30 minutes
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
        result = compare_on_ranks(modes, refs, kind)
        with open(out, "w") as fh:
            json.dump(result, fh)
        # see tests/test_distributed.py: no rank tears down while another still talks to the
        # store, and gloo's threads must not meet interpreter finalisation (os._exit)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(world, modes, tmp_path, kind="vit"):
    import torch.distributed.fsdp  # noqa: F401  (imported once, here, for every rank)
    from quotient_manifolds.adapters import GeodesicSAM  # noqa: F401

    refs = single_process_steps(kind)   # once, here: the ranks inherit them
    port = _free_port()
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_worker, args=(rank, world, port, modes, refs, kind,
                                                   str(tmp_path / f"out{rank}.json")))
             for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        if p.exitcode is None:
            for q in procs:
                q.kill()
        assert p.exitcode == 0, f"rank {procs.index(p)} exited with {p.exitcode} (traceback above)"
    return [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(world)]


def _check_equal_steps(results, modes):
    for mode in modes:
        for geometry in GEOMETRIES:
            key = f"{mode}/{geometry}"
            assert all(r[key]["norm"] == results[0][key]["norm"] for r in results), key
            assert results[0][key]["norm"] == pytest.approx(results[0][key]["norm_ref"], rel=1e-12), key
            worst = max(r[key]["rel"] for r in results)
            print(f"{key}: max relative difference {worst:.1e}")
            assert worst < 1e-10, (key, worst)


@pytest.mark.slow
def test_two_ranks_ddp_and_fsdp2_step_equals_one_process(tmp_path):
    modes = ("ddp", "ddp-no-sync", "fsdp")
    results = _run(2, modes + ("fsdp-checks",), tmp_path)
    _check_equal_steps(results, modes)
    for r in results:   # a NaN on one rank: every rank refuses, and no weight moved
        assert r["non_finite"] == {"first": "refused", "first_untouched": True,
                                   "second": "refused", "second_untouched": True}
        assert r["unused"] == {"averaged": True, "none_kept": True}
        assert r["bf16"] == {geometry: True for geometry in GEOMETRIES}
        assert r["refusals"] == {"root": True, "unverified": True, "scaler": True}


@pytest.mark.slow
def test_two_ranks_fsdp2_step_equals_one_process_on_gpt2(tmp_path):
    """GPT-2's fused c_attn: heads are columns, so every rank's dim-0 shard holds a slice of
    every head, and one parameter holds Q, K and V (two blocks share it)."""
    pytest.importorskip("transformers")
    results = _run(2, ("fsdp",), tmp_path, kind="gpt2")
    _check_equal_steps(results, ("fsdp",))


@pytest.mark.slow
def test_three_ranks_fsdp2_step_equals_one_process(tmp_path):
    results = _run(3, ("fsdp",), tmp_path)
    _check_equal_steps(results, ("fsdp",))


def test_the_docs_recipes_compile_and_call_the_api_as_it_is():
    """docs/distributed.md's scripts: valid Python, and the GeodesicSAM calls they make exist with
    those keywords (the scripts themselves need GPUs and torchrun)."""
    import inspect
    import pathlib
    import re

    from quotient_manifolds.adapters import GeodesicSAM

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 4
    for block in blocks:
        compile(block, "docs/distributed.md", "exec")
    assert "torchrun --nproc_per_node" in page and "fully_shard(model)" in page
    assert "## Sharpness of a sharded model" in page
    for method, keyword in (("first_step", "scaler"), ("first_step", "zero_grad"),
                            ("second_step", "zero_grad")):
        assert keyword in inspect.signature(getattr(GeodesicSAM, method)).parameters
