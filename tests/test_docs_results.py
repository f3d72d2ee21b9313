"""The result tables of docs/results.md, rebuilt from the committed records' summaries.

Each table below a study's heading is compared cell by cell with the `summary.json` that
`quotient-manifolds report` writes from that study's committed results.jsonl (the tests
`test_report_reproduces_the_committed_*` recompute those summaries from the records): every
number of the docs must be the summary's, rounded as printed, and a Δτ is bold exactly when its
interval excludes 0. A table the docs change by hand, or a rerun the docs do not follow, fails."""

import json
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "results.md")

#: heading of the docs section -> the committed study whose summary its table shows
SECTIONS = {
    "### Vision: ViT width 64 (4 heads of dim 16), 48 fine-tunes": "vision-finetune",
    "### Vision: ViT at the paper's head size (width 256, 4 heads of dim 64), 47 fine-tunes":
        "vision-finetune-gpu",
    "### Text: all-MiniLM-L6-v2, 30 fine-tunes differing by seed only": "text-paper-seeds",
    "### Text: the same model and data, 30 fine-tunes with random hyperparameters":
        "text-paper-random",
    "### Vision: matched loss rise (ViT width 64, 48 fine-tunes)": "matched",
}
#: the docs' name of a paired view -> the summary's
VIEWS = {"calibrated": "calibrated ρ", "calibrated / 10": "ρ × 0.1", "calibrated × 10": "ρ × 10",
         "all models": "calibrated ρ", "within stopping epoch": "calibrated ρ, within stopping epoch",
         "ρ / 10": "ρ × 0.1", "ρ × 10": "ρ × 10",
         "0.1 nat": "loss rise ≈ 0.1 nats", "1 nat": "loss rise ≈ 1 nats",
         "3 nat": "loss rise ≈ 3 nats", "3 nats": "loss rise ≈ 3 nats"}
#: the docs' name of a measure -> the records'
MEASURES = {"adaptive (ours)": "adaptive", "adaptive-andriushchenko": "adaptive-andriushchenko",
            "adaptive-andriushchenko (paper's baseline)": "adaptive-andriushchenko",
            "geodesic-inv": "geodesic-inv", "geodesic-mix": "geodesic-mix",
            "mix along the exact geodesic (256 points)": "mix-exact",
            "inv, exact geodesic": "inv-exact", "inv, second order": "geodesic-inv",
            "mix, exact geodesic": "mix-exact", "mix, second order": "geodesic-mix"}
REFERENCES = {"Δτ vs paper's baseline": "adaptive-andriushchenko",
              "Δτ vs our adaptive": "adaptive"}
NUMBER = re.compile(r"[+\-−]?\d+(?:\.\d+)?")


def _tables():
    """{heading: (header cells, rows of cells)} of the first table under each heading."""
    out, heading, rows = {}, None, []
    with open(DOC, encoding="utf-8") as fh:
        lines = fh.read().splitlines() + [""]
    for line in lines:
        if line.startswith("#"):
            heading, rows = line.strip(), []
        elif line.startswith("|") and heading is not None and heading not in out:
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows and heading not in out:
            out[heading] = (rows[0], [r for r in rows[2:]])
    return out


def _numbers(cell: str):
    """The numbers of a cell, each with its number of decimals as printed."""
    return [(float(s.replace("−", "-")), len(s.split(".")[1]) if "." in s else 0)
            for s in NUMBER.findall(cell.replace("**", ""))]


def _close(cell: str, want, where: str) -> None:
    got = _numbers(cell)
    assert len(got) == len(want), f"{where}: {cell!r} should hold {len(want)} numbers"
    for (value, decimals), w in zip(got, want):
        # as printed: the summary's value rounded to the cell's decimals (half a unit, plus
        # float noise); significant-digit cells (ρ*) use the same rule on their decimals
        assert abs(value - w) <= 0.5 * 10 ** -decimals + 1e-9, f"{where}: {cell!r} vs {want}"


def _summary(study: str):
    with open(os.path.join(REPO, "experiments", "results", study, "summary.json")) as fh:
        return json.load(fh)


@pytest.mark.parametrize("heading", list(SECTIONS))
def test_docs_result_table_is_the_committed_summary(heading):
    tables = _tables()
    assert heading in tables, f"docs/results.md has no table under {heading!r}"
    header, rows = tables[heading]
    summary = _summary(SECTIONS[heading])
    views = summary["paired"]["views"]
    col = {name: k for k, name in enumerate(header)}
    tau_col = next(k for k, name in enumerate(header) if name.startswith("τ-b"))
    assert rows, heading
    for row in rows:
        view = views[VIEWS[row[0]]]
        measure = MEASURES[row[1]]
        entry = view["rows"][measure]
        where = f"{heading} / {row[0]} / {row[1]}"
        _close(row[tau_col], [entry["tau_b"], entry["ci_low"], entry["ci_high"]], where)
        for name, ref in REFERENCES.items():
            cell = row[col[name]].replace("**", "").strip()
            if ref == measure:
                assert cell == "—", where
                continue
            if not cell:         # the docs leave out a comparison (e.g. not measured at /10)
                continue
            d = entry["vs"][ref]
            _close(cell, [d["delta"], d["ci_low"], d["ci_high"]], f"{where} / {name}")
            excludes_zero = d["ci_low"] > 0 or d["ci_high"] < 0
            assert row[col[name]].startswith("**") == excludes_zero, \
                f"{where} / {name}: bold exactly when the interval excludes 0"
        if "ρ*" in col:          # the matched table: calibration columns
            level = VIEWS[row[0]].split("≈ ")[1].split(" ")[0]
            m = summary["matched"][level][measure]
            _close(row[col["ρ*"]], [m["rho"]], where)
            _close(row[col["median loss rise"]], [m["median_loss_rise"]], where)
            _close(row[col["attention share"]], [m["median_attention_share"]], where)


def test_every_committed_paired_row_is_in_the_docs():
    """No row of a committed paired table is left out of its docs table (the docs may leave out a
    comparison cell, not a measure)."""
    tables = _tables()
    for heading, study in SECTIONS.items():
        rows = tables[heading][1]
        shown = {(VIEWS[r[0]], MEASURES[r[1]]) for r in rows}
        for view, v in _summary(study)["paired"]["views"].items():
            for measure in v["rows"]:
                if view in {VIEWS[r[0]] for r in rows}:
                    assert (view, measure) in shown, f"{heading}: {view} / {measure} missing"


@pytest.mark.parametrize("study", ["vision-finetune", "vision-finetune-gpu"])
def test_summary_medians_are_the_records_medians(study):
    """The median value of each main measure at its ρ (the column that shows whether measures
    were compared at similar loss rises), computed here from results.jsonl and config.json alone,
    is the committed summary's: exact mix at the second-order mix ρ is ~20× below the others."""
    import numpy as np
    src = os.path.join(REPO, "experiments", "results", study)
    with open(os.path.join(src, "config.json")) as fh:
        rho = json.load(fh)["rho_used"]
    with open(os.path.join(src, "results.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    family = {"adaptive": "adaptive", "adaptive-andriushchenko": "adaptive",
              "geodesic-inv": "inv", "geodesic-mix": "mix", "mix-exact": "mix"}
    main = _summary(study)["main"]
    for measure, fam in family.items():
        values = [e["value"] for r in records for e in r["sharpness"]
                  if e["measure"] == measure and abs(e["rho"] - rho[fam]) <= 1e-9 * rho[fam]]
        assert len(values) == len(records)
        assert main[measure]["median_value"] == pytest.approx(float(np.median(values)), rel=1e-12)
    assert main["mix-exact"]["median_value"] < main["adaptive-andriushchenko"]["median_value"] / 6


#: the "At a glance" rows (in order) and where their four τ come from: (study, paired view,
#: the measures of the columns paper's baseline, our adaptive, inv, mix)
GLANCE = [
    ("matched", "loss rise ≈ 0.1 nats", ("adaptive-andriushchenko", "adaptive", "inv-exact",
                                         "mix-exact")),
    ("matched", "loss rise ≈ 1 nats", ("adaptive-andriushchenko", "adaptive", "inv-exact",
                                       "mix-exact")),
    ("vision-finetune", "calibrated ρ", ("adaptive-andriushchenko", "adaptive", "geodesic-inv",
                                         "geodesic-mix")),
    ("vision-finetune-gpu", "calibrated ρ", ("adaptive-andriushchenko", "adaptive",
                                             "geodesic-inv", "geodesic-mix")),
    ("text-paper-seeds", "calibrated ρ", ("adaptive-andriushchenko", "adaptive", "geodesic-inv",
                                          "geodesic-mix")),
    ("text-paper-random", "calibrated ρ", ("adaptive-andriushchenko", "adaptive", "geodesic-inv",
                                           "geodesic-mix")),
]


def test_at_a_glance_taus_are_the_committed_summaries():
    header, rows = _tables()["## At a glance"]
    assert header[1:5] == ["paper's baseline", "our adaptive", "inv", "mix"]
    for row, (study, view, measures) in zip(rows, GLANCE):
        got = _summary(study)["paired"]["views"][view]["rows"]
        for cell, m in zip(row[1:5], measures):
            _close(cell, [got[m]["tau_b"]], f"At a glance / {row[0]} / {m}")


def _table_from(path: str, header: str):
    """Rows (cells) of the table whose header line starts with ``header``, without the header and
    the separator line."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.parametrize("study,marker", [
    ("vision-finetune", "| measure | ρ / calibrated ρ = 0.1 (256 points) | 1 (main, 1,024"),
    ("vision-finetune-gpu", "| measure | ρ / calibrated ρ = 0.1 (256 points) | 1 (main, 2,048")])
def test_experiments_readme_vision_tables_are_the_committed_summaries(study, marker):
    """experiments/README.md's marginal τ tables (2,000 resamples; included in docs/studies.md):
    the ρ sweep, the main measures and the curvature, each cell the committed summary's."""
    rows = _table_from(os.path.join(REPO, "experiments", "README.md"), marker)
    s = _summary(study)
    names = {"geodesic-mix (second order)": "geodesic-mix", "mix-exact (256 points)": "mix-exact"}
    curvature = {"inv metric": "inv", "mix metric": "mix", "Euclidean": "euclidean"}
    assert len(rows) == 8
    for row in rows:
        if row[0].startswith("Hessian"):
            kind = curvature[row[0].split(", ")[1]]
            _close(row[1], [s["curvature"][f"hess-trace-{kind}"]["tau_b"],
                            s["curvature"][f"hess-lmax-{kind}"]["tau_b"]], row[0])
            continue
        m = names.get(row[0], row[0])
        main = s["main"][m]
        _close(row[2], [main["tau_b"], main["ci_low"], main["ci_high"]], f"{study} {m} main")
        sweep = {round(r["rho"] / main["rho"], 6): r for r in s["sweep"].get(m, [])}
        for cell, factor in ((row[1], 0.1), (row[3], 10.0)):
            if cell:
                r = sweep[factor]
                _close(cell, [r["tau_b"], r["ci_low"], r["ci_high"]], f"{study} {m} ×{factor}")
