"""The matched loss-rise study (experiments/matched.py): the whole pipeline on a tiny synthetic
configuration (pretraining, pilot calibration per measure and level, every model at ρ*, report
and figure), `report DIR` reproducing it, and resume after an interruption giving the records of
an uninterrupted run."""

import json
import math
import os

import numpy as np
import pytest

from quotient_manifolds.experiments import matched as MT
from quotient_manifolds.experiments.cli import main
from quotient_manifolds.experiments.provenance import weights_hash
from quotient_manifolds.experiments.report import report_from_results
from quotient_manifolds.experiments.checkpoints import load_checkpoint

# the pipeline is the study's; the RK4 steps of the exact geodesic are cut (32 and 8 -> 2: the
# fixture below) so that the exact measures take a fraction of a second on the tiny model
FAST = ["--quick", "--synthetic", "--no-progress", "--threads", "1", "--models", "2",
        "--pilot-models", "1", "--n-iters", "1"]
#: fields that differ between two runs of the same configuration (times, dates, checksums) or
#: with where the checkpoints came from
VOLATILE = {"timing", "finished", "_sha256", "time_s", "reused_checkpoint", "checkpoint", "created",
            "wall_s"}


@pytest.fixture(autouse=True)
def _short_geodesics(monkeypatch):
    import importlib

    from quotient_manifolds.core.gl import GLQuotientGeometry
    monkeypatch.setitem(GLQuotientGeometry.__init__.__kwdefaults__, "exact_steps", 2)
    monkeypatch.setattr(importlib.import_module("quotient_manifolds.adapters.worst_case"), "CHECK_EXACT_STEPS", 2)


def _json(path):
    with open(path) as fh:
        return json.load(fh)


def _lines(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _rounded(obj, digits: int = 12):
    """``obj`` with every float rounded to ``digits`` significant digits: another numpy release
    (2.5 against 2.4) moves the last digits of the medians."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v, digits) for v in obj]
    return obj


def _stable(obj):
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_stable(v) for v in obj]
    return obj


@pytest.mark.slow
def test_matched_pipeline_and_report(tmp_path):
    out = str(tmp_path / "m")
    assert main(["matched", *FAST, "--out", out]) == 0
    cal = _json(os.path.join(out, "calibration.json"))
    config = _json(os.path.join(out, "config.json"))
    assert cal["pilot_models"] == [0] and config["rho_used"] == cal["rho"]
    recs = _lines(os.path.join(out, "results.jsonl"))
    assert [r["model_id"] for r in recs] == [0, 1]
    levels = MT.defaults(True, True)["levels"]        # the quick levels: 0.1 and 3 nats
    assert levels == [0.1, 3.0] and MT.defaults(False, False)["levels"] == [0.1, 1.0, 3.0]
    pairs = {(m, lv) for m in MT.MATCHED_MEASURES for lv in levels}
    for r in recs:
        assert {(e["measure"], e["level"]) for e in r["sharpness"]} == pairs
        for e in r["sharpness"]:
            # every model at the one calibrated ρ* of its measure and level
            assert e["rho"] == cal["rho"][e["measure"]][MT.level_key(e["level"])]
            assert e["n_points"] == 32 and ("error" in e) == (not math.isfinite(e["value"]))
            if "error" not in e:  # the share of the worst ξ's norm in the GL blocks
                (share,) = e["gl_norm_shares"]  # (NaN: no ascent found, ξ = 0)
                assert math.isnan(share) or 0.0 <= share <= 1.0
                (on_attention,) = e["attention_norm_shares"]  # in every geometry
                assert math.isnan(on_attention) or 0.0 <= on_attention <= 1.0
                if e["geometry"] == "adaptive":
                    assert share == 0.0 or math.isnan(share)
                else:
                    assert on_attention == share or math.isnan(share)
        assert r["study_config"]["rho"] == cal["rho"] and "gap_own" in r["metrics"]
    # traceable: the code's commit and versions, and the hash of the checkpoint's weights
    for r in recs:
        assert r["provenance"]["torch"] and "commit" in r["provenance"]
        tensors, _ = load_checkpoint(os.path.join(out, "checkpoints", os.path.basename(
            r["checkpoint"])))
        assert r["weights_sha256"] == weights_hash(tensors)
    # the pilot's per-model search is kept: every evaluation, and how many left GL
    pilot = _lines(os.path.join(out, "calibration.jsonl"))
    assert len(pilot) == 1 and len(pilot[0]["searches"]) == len(pairs)
    # each measure searched with its own retraction: the exact and the second-order mix
    # measures evaluated separately, each ρ* from its own search
    for level in levels:
        exact, second = (pilot[0]["searches"][f"{m}@{MT.level_key(level)}"]
                         for m in ("mix-exact", "geodesic-mix"))
        assert exact["evals"][0][0] == pytest.approx(MT._start(config["config"], "mix-exact",
                                                               level))
        assert exact["evals"][0][0] != second["evals"][0][0]
    assert all("failures" in s and s["evals"] for s in pilot[0]["searches"].values())
    summary = _json(os.path.join(out, "summary.json"))
    views = summary["paired"]["views"]
    assert set(views) == {"loss rise ≈ 0.1 nats", "loss rise ≈ 3 nats"}
    for v in views.values():
        assert v["references"] == ["adaptive-andriushchenko", "adaptive"]
        assert set(v["rows"]["inv-exact"]["vs"]) == {"adaptive-andriushchenko", "adaptive"}
    for level in ("0.1", "3"):
        for m in MT.MATCHED_MEASURES:
            got = summary["matched"][level][m]
            assert got["failures"] == int(MT.failed(recs, m, float(level)).sum())
    with open(os.path.join(out, "summary.md")) as fh:
        md = fh.read()
    assert "exact-geodesic failures" in md and "Δτ vs adaptive-andriushchenko" in md
    # only 2 models: no τ, so no figure; `report DIR` rewrites the same summary
    os.rename(os.path.join(out, "summary.json"), os.path.join(out, "run.json"))
    report_from_results(out, log=lambda msg: None)
    again = _json(os.path.join(out, "summary.json"))
    assert _stable(again) == _stable(_json(os.path.join(out, "run.json")))


def test_matched_report_table_figure_and_failures(tmp_path):
    """The report of 5 synthetic records: τ and Δτ per level, a failure counted and ranked as
    the sharpest in the last column, and the figure."""
    config = MT.defaults(True, True)
    levels = config["levels"] = [0.1, 1.0]
    config["rho"] = {m: {MT.level_key(lv): 0.1 * (k + 1) for lv in levels}
                     for k, m in enumerate(config["measures"])}
    rng = np.random.default_rng(0)
    gaps = rng.uniform(0.0, 0.1, 5)
    records = []
    for i, gap in enumerate(gaps):
        entries = []
        for lv in levels:
            for m in config["measures"]:
                e = dict(measure=m, level=lv, rho=config["rho"][m][MT.level_key(lv)],
                         value=float(lv * (1 + gap)),
                         attention_norm_shares=[0.25 if m.startswith("adaptive") else 0.5])
                if m == "mix-exact" and lv == 1.0 and i == int(np.argmax(gaps)):
                    e.update(value=float("nan"), error="the exact geodesic left GL(h)")
                entries.append(e)
        records.append(dict(model_id=i, study_config=config, sharpness=entries,
                            metrics=dict(gap_own=float(gap), own_train_error=0.0)))
    summary = MT.report(str(tmp_path), config, "h", records)
    row = summary["matched"]["1"]["mix-exact"]
    assert row["failures"] == 1 and row["models"] == 5
    # the failure is the model with the largest gap: ranked sharpest, τ-b is +1
    assert row["tau_failures_sharpest"]["tau_b"] == pytest.approx(1.0)
    assert summary["paired"]["views"]["loss rise ≈ 1 nats"]["rows"]["mix-exact"]["n"] == 4
    assert summary["matched"]["0.1"]["geodesic-mix"]["median_attention_share"] == 0.5
    assert summary["matched"]["0.1"]["adaptive"]["median_attention_share"] == 0.25
    assert summary["matched"]["0.1"]["adaptive"]["median_second_order_gap"] is None
    assert os.path.getsize(os.path.join(tmp_path, "fig_matched.png")) > 0


@pytest.mark.slow
def test_matched_resume_after_interruption(tmp_path, monkeypatch):
    """Interrupted once in the pilot and once among the models, then resumed: the same records
    as an uninterrupted run (times, dates and checksums aside)."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "int")
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    real_pilot, real_job = MT.pilot_job, MT.job

    def interrupt_at(fn, model_id):
        def wrapped(i, *args):
            if i == model_id:
                raise KeyboardInterrupt  # as a kill between two models: nothing of i written
            return fn(i, *args)
        return wrapped

    args = ["matched", *FAST, "--pilot-models", "2", "--levels", "1", "--out", out, *ckpt]
    assert main(["matched", *FAST, "--pilot-models", "2", "--levels", "1", "--out", ref,
                 *ckpt]) == 0
    monkeypatch.setattr(MT, "pilot_job", interrupt_at(real_pilot, 1))
    assert main(args) == 130
    assert len(_lines(os.path.join(out, "calibration.jsonl"))) == 1
    assert not os.path.exists(os.path.join(out, "results.jsonl"))
    monkeypatch.setattr(MT, "pilot_job", real_pilot)
    monkeypatch.setattr(MT, "job", interrupt_at(real_job, 1))
    assert main(args) == 130
    assert [r["model_id"] for r in _lines(os.path.join(out, "results.jsonl"))] == [0]
    monkeypatch.setattr(MT, "job", real_job)
    assert main(args) == 0
    for name in ("calibration.jsonl", "results.jsonl"):
        got, want = _lines(os.path.join(out, name)), _lines(os.path.join(ref, name))
        assert [r["model_id"] for r in got] == [r["model_id"] for r in want]
        assert _stable(got) == _stable(want), name


def test_combine_roots_reproduces_the_committed_vision_calibration():
    """calibrate.combine (now over combine_roots, which the matched study shares) gives the
    committed calibration.json of the vision fine-tunes from its pilot records."""
    from quotient_manifolds.experiments import calibrate
    d = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                     "results", "vision-finetune")
    config = _json(os.path.join(d, "config.json"))
    cal = _json(os.path.join(d, "calibration.json"))
    got = calibrate.combine(_lines(os.path.join(d, "calibration.jsonl")), config["config"],
                            config["config_hash"])
    assert _rounded(got["families"]) == _rounded(cal["families"])
    assert _rounded(got["rho"]) == _rounded(cal["rho"])


def test_report_reproduces_the_committed_matched_summary(tmp_path):
    """experiments/results/matched holds the study's records: `report DIR` recomputes its summary
    from them alone, every number (the paired Δτ tables with their fixed resamples and seed, ρ*,
    loss rises, failures, attention shares, second-order gaps) equal to the committed one."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                       "results", "matched")
    committed = _json(os.path.join(src, "summary.json"))
    assert main(["report", src, "--out", str(tmp_path)]) == 0
    again = _json(os.path.join(tmp_path, "summary.json"))
    assert committed["used"] == committed["models"] == 48, "the committed study is complete"
    for key in ("paired", "matched", "levels", "measures", "excluded", "config_hash", "used",
                "level_changes"):
        _assert_close(again[key], committed[key], key)


def _assert_close(got, want, where: str) -> None:
    """Nested JSON values equal, numbers to 1e-12 (nan equal to nan)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, abs=1e-12, nan_ok=True), where
    else:
        assert got == want, where
