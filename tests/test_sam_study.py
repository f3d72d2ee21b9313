"""The SAM training study (``quotient-manifolds sam``, experiments/sam_study.py): the job plan
and the ρ selection, one update of each arm against a hand-written reference, the shared dropout
mask of the two SAM passes, and ``--quick`` runs end to end (resume, report from results.jsonl).
Every test runs on one torch thread on SYNTHETIC data in seconds."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from quotient_manifolds.experiments import sam_study as S
from quotient_manifolds.experiments import sam_training as ST
from quotient_manifolds.experiments.cli import main


def run(argv):
    return main(list(argv) + ["--threads", "1", "--no-progress"])


def _lines(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ------------------------------------------------------------------------------------ plan, selection
def test_plan_selection_and_seed_phase():
    config = S.defaults(True)
    jobs = S.plan(config)
    per_task = 1 + sum(len(S.rho_grid(t, m)) * config["seeds"] for t in config["tasks"].values()
                       for m in config["methods"]) // len(config["tasks"])
    assert len(jobs) == per_task * len(config["tasks"])
    keys = [(j["task"], j.get("method"), j.get("rho_index"), j.get("seed")) for j in jobs]
    assert len(set(keys)) == len(keys)
    # job ids do not depend on the key order of a configuration read back from JSON
    reordered = json.loads(json.dumps(config, sort_keys=True))
    assert list(reordered["tasks"]) != list(config["tasks"]) and S.plan(reordered) == jobs
    # each SAM arm sweeps the same multipliers of its own centre
    t = config["tasks"]["vit"]
    for m in S.SAM_METHODS:
        assert S.rho_grid(t, m) == pytest.approx([t["rho"][m] * f for f in t["rho_factors"]])
    sweep = set(S.sweep_ids(config))
    for i, j in enumerate(jobs):
        in_sweep = j["kind"] == "timing" or S.METHODS[j["method"]] is None or j["seed"] == 0
        assert (i in sweep) == in_sweep

    # fabricated sweep: sam best at index 2, asam tie between 0 and 2 -> nearest the centre wins
    # only if equal distance: both are 1 away, so the tie goes to the higher score order; give
    # geodesic-inv a tie between index 1 (centre) and 2 -> centre
    val = {("vit", "sam"): [0.5, 0.6, 0.7], ("vit", "asam"): [0.8, 0.1, 0.7],
           ("vit", "geodesic-inv"): [0.1, 0.9, 0.9], ("vit", "geodesic-mix"): [0.3, 0.2, None]}
    recs = []
    for (task, m), vals in val.items():
        for ri, v in enumerate(vals):
            if v is not None:
                recs.append(dict(kind="train", task=task, method=m, rho_index=ri, seed=0,
                                 metrics=dict(val_acc=v)))
    # a better score on a non-sweep seed must not count
    recs.append(dict(kind="train", task="vit", method="sam", rho_index=0, seed=1,
                     metrics=dict(val_acc=1.0)))
    sel = S.select_rho(recs, config)
    assert sel[("vit", "sam")] == 2
    assert sel[("vit", "asam")] == 0
    assert sel[("vit", "geodesic-inv")] == 1
    assert sel[("vit", "geodesic-mix")] == 0
    assert sel[("vit", "base")] == 0 and ("minilm", "sam") not in sel
    ids = S.seed_ids(config, sel)
    assert ids and all(jobs[i]["seed"] >= 1 and jobs[i]["task"] == "vit" for i in ids)
    assert {(jobs[i]["method"], jobs[i]["rho_index"]) for i in ids} == \
        {("sam", 2), ("asam", 0), ("geodesic-inv", 1), ("geodesic-mix", 0)}
    # the longest jobs (MiniLM SAM arms) are started first
    order = S.longest_first(config, list(range(len(jobs))))
    assert sorted(order) == list(range(len(jobs)))


# ------------------------------------------------------------------------------------ one update
def _tiny_vit_task():
    config = S.defaults(True)
    cfg = config["tasks"]["vit"]
    return ST.get_task("vit", cfg, None), cfg


@pytest.mark.parametrize("method", ["base", "sam", "asam"])
def test_one_update_matches_a_hand_written_reference(method):
    """Base: clip(∇L(w)) then AdamW. SAM: w_adv = w + ρ∇/‖∇‖; ASAM: w_adv = w + ρ w²∇/‖|w|∇‖;
    then clip(∇L(w_adv)) and AdamW from w."""
    task, cfg = _tiny_vit_task()
    torch.manual_seed(0)
    model = task.build(3).double().train()
    ref = copy.deepcopy(model)
    batch = next(task.batches(3))
    batch = (batch[0].double(), batch[1])
    rho = 0.3
    opt, sam = ST.make_optimizer(model, cfg, method, rho)
    ST.Updater(task, model, opt, sam)(batch)

    params = [p for p in ref.parameters() if p.requires_grad]
    loss = task.loss(ref, batch)
    grads = torch.autograd.grad(loss, params)
    if method != "base":
        with torch.no_grad():
            if method == "sam":
                norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
                eps = [rho * g / norm for g in grads]
            else:
                norm = torch.sqrt(sum(((p.abs() * g) ** 2).sum() for p, g in zip(params, grads)))
                eps = [rho * p ** 2 * g / norm for p, g in zip(params, grads)]
            saved = [p.detach().clone() for p in params]
            for p, e in zip(params, eps):
                p.add_(e)
        grads = torch.autograd.grad(task.loss(ref, batch), params)
        with torch.no_grad():
            for p, w in zip(params, saved):
                p.copy_(w)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    ref_opt, _ = ST.make_optimizer(ref, cfg, "base", 0.0)
    ref_opt.step()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), n
    moved = max(float((a - b).detach().abs().max()) for a, b in
                zip(model.parameters(), task.build(3).double().parameters()))
    assert moved > 1e-4  # the update did something
    if method != "base":  # and the comparison is sharp enough to see ρ
        other = task.build(3).double().train()
        opt, sam = ST.make_optimizer(other, cfg, method, 2 * rho)
        ST.Updater(task, other, opt, sam)(batch)
        assert not all(torch.allclose(a, b, rtol=1e-9, atol=1e-12)
                       for a, b in zip(other.parameters(), ref.parameters()))


def test_sam_passes_share_the_dropout_mask():
    """With dropout on, the loss at w_adv for a tiny ρ equals the loss at w only if both passes
    draw the same mask; the base arm's loss is the plain training loss."""
    config = S.defaults(True)
    cfg = config["tasks"]["minilm"]
    task = ST.get_task("minilm", cfg, None)
    torch.manual_seed(0)
    model = task.build(5).train()
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    opt, sam = ST.make_optimizer(model, cfg, "geodesic-inv", 1e-7)
    upd = ST.Updater(task, model, opt, sam)
    batch = next(task.batches(5))
    for _ in range(3):
        loss = upd(batch)
        assert abs(upd.loss_adv - loss) < 1e-4 * max(1.0, abs(loss))
    # and the masks do differ from one update to the next (dropout is on)
    torch.manual_seed(1)
    with torch.no_grad():
        a = float(task.loss(model, batch))
        b = float(task.loss(model, batch))
    assert abs(a - b) > 1e-6


# ------------------------------------------------------------------------------------ end to end
def test_quick_vit_end_to_end_resume_and_report(tmp_path):
    out = str(tmp_path / "sam")
    assert run(["sam", "--quick", "--tasks", "vit", "--out", out]) == 0
    config = S.defaults(True)
    steps, seeds = config["tasks"]["vit"]["steps"], config["seeds"]
    recs = _lines(os.path.join(out, "results.jsonl"))
    timing = [r for r in recs if r["kind"] == "timing"]
    train = [r for r in recs if r["kind"] == "train"]
    assert len(timing) == 1 and timing[0]["timing"]["ratio_to_sam"]["sam"] == pytest.approx(1.0)
    assert set(timing[0]["timing"]["update_median_s"]) == {m for m in S.METHODS if m != "base-2x"}
    # sweep on seed 0 (3 ρ per SAM arm), then the other seed at the selected ρ only
    sel = S.select_rho(train, config)
    for m in S.METHODS:
        rs = [r for r in train if r["method"] == m]
        if S.METHODS[m] is None:
            assert sorted(r["seed"] for r in rs) == list(range(seeds))
            continue
        assert sorted(r["rho_index"] for r in rs if r["seed"] == 0) == [0, 1, 2]
        later = [r for r in rs if r["seed"] > 0]
        assert len(later) == seeds - 1 and all(r["rho_index"] == sel[("vit", m)] for r in later)
    # equal step budgets: every arm the same number of updates (base-2x: equal gradients)
    for r in train:
        want = steps * S.STEP_FACTOR.get(r["method"], 1)
        assert r["updates"] == want
        assert r["grad_evals"] == want * (1 if S.METHODS[r["method"]] is None else 2)
        assert 0 <= r["metrics"]["test_acc"] <= 1 and math.isfinite(r["metrics"]["train_loss"])
        assert [c["update"] for c in r["curve"]][-1] == want
        assert r["timing"]["update_median_s"] > 0
    # paired runs: the same seed index gives the same init for every arm
    assert len({r["hparams"]["torch_seed"] for r in train if r["seed"] == 0}) == 1
    with open(os.path.join(out, "summary.md")) as fh:
        summary = fh.read()
    assert "SYNTHETIC" in summary and "| geodesic-mix |" in summary and "ρ sweep" in summary
    for fig in ("fig_rho_sweep.png", "fig_curves.png"):
        assert os.path.getsize(os.path.join(out, fig)) > 1000

    # rerun: nothing recomputed
    n = len(recs)
    assert run(["sam", "--quick", "--tasks", "vit", "--out", out]) == 0
    assert len(_lines(os.path.join(out, "results.jsonl"))) == n

    # the report is recomputed from results.jsonl alone
    with open(os.path.join(out, "summary.json")) as fh:
        before = json.load(fh)
    os.remove(os.path.join(out, "summary.md"))
    assert main(["report", out]) == 0
    with open(os.path.join(out, "summary.json")) as fh:
        after = json.load(fh)
    assert after["tasks"] == before["tasks"] and after["verdicts"] == before["verdicts"]
    assert os.path.exists(os.path.join(out, "summary.md"))


def test_quick_minilm_subset_of_arms(tmp_path):
    out = str(tmp_path / "sam")
    assert run(["sam", "--quick", "--tasks", "minilm", "--methods", "base,sam,geodesic-mix",
                "--seeds", "2", "--rho-factors", "0.5,2", "--out", out]) == 0
    recs = _lines(os.path.join(out, "results.jsonl"))
    train = [r for r in recs if r["kind"] == "train"]
    assert {r["method"] for r in train} == {"base", "sam", "geodesic-mix"}
    assert sorted(r["rho_factor"] for r in train if r["method"] == "sam" and r["seed"] == 0) \
        == [0.5, 2.0]
    assert all(r["task"] == "minilm" for r in recs)
    with open(os.path.join(out, "summary.json")) as fh:
        s = json.load(fh)
    row = s["tasks"]["minilm"]["methods"]["geodesic-mix"]
    assert row["n_seeds"] == 2 and row["update_ratio_same_process"] > 0


def test_cli_errors_are_actionable(tmp_path, capsys):
    out = str(tmp_path / "x")
    assert run(["sam", "--quick", "--methods", "sam,nope", "--out", out]) == 2
    assert "unknown method(s) ['nope']" in capsys.readouterr().err
    assert run(["sam", "--quick", "--methods", "base,asam", "--out", out]) == 2
    assert "keep 'sam'" in capsys.readouterr().err
    assert run(["sam", "--quick", "--seeds", "2", "--sweep-seeds", "3", "--out", out]) == 2
    assert "--sweep-seeds 3" in capsys.readouterr().err
    assert run(["sam", "--quick", "--rho-centre", "vit-sam-0.1", "--out", out]) == 2
    assert "TASK:METHOD=RHO" in capsys.readouterr().err
    assert run(["sam", "--quick", "--tasks", "resnet", "--out", out]) == 2
    assert "valid tasks" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "results.jsonl"))
