"""What a study's --quick run and its summary say: that it is a smoke test whose numbers mean
nothing (first and last on the console, under summary.md's title), never a "[nan, nan]" interval,
no paper column beside a smoke test's numbers, and the main ρ named as it was chosen (calibrated
or configured)."""

from __future__ import annotations

import json
import math

import pytest

from quotient_manifolds.experiments import diagonal, text
from quotient_manifolds.experiments.cli import main
from quotient_manifolds.experiments.population_summary import population_report
from quotient_manifolds.experiments.reporting import SMOKE_TEST, is_smoke_test, print_table, rho_label
from quotient_manifolds.experiments.stats import DeltaTauResult, TauResult, tau_with_ci


def test_an_undefined_interval_says_why_instead_of_nan():
    few = tau_with_ci([1.0, 2.0], [3.0, 5.0], n_boot=50)     # two models: τ, but no bootstrap CI
    assert math.isfinite(few.tau_b) and math.isnan(few.ci_low)
    assert few.fmt() == "+1.00 [CI n/a: too few models]" and "nan" not in few.fmt()
    assert TauResult(0.5, 0.5, -0.1, 0.9, 9).fmt() == "+0.50 [-0.10, +0.90]"
    assert TauResult(math.nan, math.nan, math.nan, math.nan, 1).fmt() == "n/a"
    assert DeltaTauResult(0.2, math.nan, math.nan, 0.5, 0.3, 2).fmt() == "+0.20"  # Δτ: bare


def test_every_quick_configuration_is_marked_and_no_full_one_is():
    for quick, full in ((diagonal.defaults(True), diagonal.defaults(False)),
                        (text.defaults(True, False), text.defaults(False, False)),
                        (text.defaults(True, True, "paper"), text.defaults(False, True, "paper"))):
        assert is_smoke_test(quick) and not is_smoke_test(full) and "quick" not in full


def test_rho_is_named_as_it_was_chosen():
    small, paper = text.defaults(False, False), text.defaults(False, False, "paper")
    assert rho_label(small, None) == "configured ρ"                   # no calibration at all
    assert rho_label(paper, {"calibrated": ["mix"]}) == "calibrated ρ"  # calibrated on its pilot
    assert rho_label(paper, None) == "configured ρ"                     # its calibration not run
    fixed = dict(paper, calibration=dict(paper["calibration"], families=[]))
    assert rho_label(fixed, None) == "calibrated ρ"                     # all given: another's result


def _records(n: int):
    return [dict(model_id=i, hparams=dict(seed=i, lr=1e-4 * (i + 1)),
                 metrics=dict(gap=0.1 * (i % 3), train_loss=0.5 - 0.01 * i),
                 sharpness=[dict(measure="adaptive", rho=0.3, value=1.0 + i, n_points=8)])
            for i in range(n)]


@pytest.mark.parametrize("quick", [True, False])
def test_a_quick_population_summary_says_smoke_test_and_has_no_paper_column(tmp_path, quick, capsys):
    pytest.importorskip("matplotlib")
    config = dict(models=3, **({"quick": True} if quick else {}))
    summary = population_report(str(tmp_path), "text", config, "hash", _records(3), target="gap",
                                main=["adaptive"], default_rho={"adaptive": 0.3}, n_boot=50)
    md = (tmp_path / "summary.md").read_text()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert "nan" not in md.split("## Configuration")[0]
    assert summary["rho_label"] == saved["rho_label"] == "configured ρ"
    assert "| measure | configured ρ |" in md and "calibrated" not in md.split("## Configuration")[0]
    print_table(summary)
    table = capsys.readouterr().out
    assert "configured rho" in table and "nan" not in table
    if quick:
        assert summary["smoke_test"] and saved["smoke_test"]
        assert md.splitlines()[2] == f"> **{SMOKE_TEST}**"                  # under the title
        assert "MNLI" not in md and "paper τ" not in md and "| +0.06 |" not in md
        assert "paper" not in table
    else:
        assert "smoke_test" not in saved and SMOKE_TEST not in md
        assert "MNLI (BERT)" in md and "paper" in table


def test_a_quick_study_says_it_first_and_last(monkeypatch, capsys):
    monkeypatch.setattr(diagonal, "run", lambda args, log: log("the study's own lines") or 0)
    assert main(["diagonal", "--quick"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [SMOKE_TEST, "the study's own lines", SMOKE_TEST]
    assert main(["diagonal"]) == 0
    assert capsys.readouterr().out.splitlines() == ["the study's own lines"]
