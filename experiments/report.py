r"""``quotient-manifolds report DIR``: a study's summary recomputed from its ``results.jsonl``
(:func:`report_from_results`), through the study's report: the population report of text and
vision (:mod:`quotient_manifolds.experiments.population_summary`, with second passes merged by
:func:`merge_second_pass`), the diagonal report
(:mod:`quotient_manifolds.experiments.diagonal_summary`) or the study's own ``report``."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import calibrate
from .diagonal_summary import diagonal_report
from .population_summary import population_kwargs, population_report
from .provenance import commits_of
from .reporting import stamp_provenance
from .runner import ExperimentError, ResultStore
from .stats import kendall_tau_b
from .studies import STUDY


# ------------------------------------------------------------------------------------ `report`
def read_records(path: str) -> List[Dict[str, Any]]:
    """The valid records of a results.jsonl, read only, as the runner reads them: a corrupt line
    that is not the last raises :class:`~quotient_manifolds.experiments.runner.ExperimentError` (a report must not
    silently lose a model); a partial last line (a study still writing, or killed mid-write) is
    left out with a note on stderr and repaired by the next run of the study."""
    records, tail = ResultStore(path).scan()
    if tail is not None:
        print(f"note: {path}: the last line is partial or corrupt and is left out of this report "
              f"(rerunning the study repairs it)", file=sys.stderr)
    return records


def _results_file(path: str) -> str:
    src = os.path.join(path, "results.jsonl") if os.path.isdir(path) else path
    if not os.path.exists(src):
        raise ExperimentError(f"no results.jsonl at {path}")
    return src


def _records_of_one_config(src: str, config_hash: Optional[str] = None
                           ) -> Tuple[str, List[Dict[str, Any]], List[str]]:
    """(chosen hash, its records sorted by model id, all hashes present) of a results.jsonl; the
    chosen configuration is ``config_hash``, else that of the last line."""
    records = read_records(src)
    if not records:
        raise ExperimentError(f"{src} holds no valid result lines")
    hashes = list(dict.fromkeys(r.get("config_hash") for r in records))
    chosen = config_hash or records[-1].get("config_hash")
    if chosen not in hashes:
        raise ExperimentError(f"config hash {chosen} not in {src} (present: {', '.join(hashes)})")
    return chosen, _one_per_model(src, [r for r in records if r.get("config_hash") == chosen]), hashes


def _one_per_model(src: str, records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``records`` (of one configuration) with one record per model id, the last one written, as
    the runner keeps them on resume (a duplicated line, e.g. from concatenated or copied results,
    would otherwise count its model twice in every statistic); sorted by model id. Duplicates
    are noted on stderr."""
    by_id: Dict[Any, Dict[str, Any]] = {}
    repeated: Dict[Any, int] = {}
    for r in records:
        if r["model_id"] in by_id:
            repeated[r["model_id"]] = repeated.get(r["model_id"], 1) + 1
        by_id[r["model_id"]] = r
    if repeated:
        shown = ", ".join(f"{i} ({n}x)" for i, n in list(repeated.items())[:8])
        dropped = sum(repeated.values()) - len(repeated)
        print(f"warning: {src}: {len(repeated)} model id(s) appear on more than one line ({shown}"
              f"{', ...' if len(repeated) > 8 else ''}); {dropped} earlier line(s) dropped: each "
              f"model is counted once, from its last line, as the study's runner reads them",
              file=sys.stderr)
    return sorted(by_id.values(), key=lambda r: r["model_id"])


def merge_second_pass(records: List[Dict[str, Any]], config: Dict[str, Any], extra_src: str,
                      log=print) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Add the sharpness values of a second pass over the same models (a run from the first
    pass's checkpoints with other ``--measures`` / ρ, written to its own directory) to the first
    pass's records. A model is matched by id and must have the same seed and hyperparameters (else
    it is not the same model and the merge stops); a (measure, ρ) the first pass already holds is
    kept from the first pass. Returns new records and the configuration with the union of both
    passes' measures; models of the first pass missing from the second simply lack its values."""
    _, extra, _ = _records_of_one_config(extra_src)
    by_id = {r["model_id"]: r for r in extra}
    if extra[0].get("study") != records[0].get("study"):
        raise ExperimentError(f"{extra_src} holds the {extra[0].get('study')!r} study, not "
                              f"{records[0].get('study')!r}: pass a second pass of the same study")
    merged, added = [], 0
    for r in records:
        e = by_id.get(r["model_id"])
        if e is None:
            merged.append(r)
            continue
        if e.get("seed") != r.get("seed") or e.get("hparams") != r.get("hparams"):
            raise ExperimentError(
                f"model {r['model_id']} of {extra_src} has other seed/hyperparameters than the "
                "first pass: a second pass must run from the first pass's checkpoints "
                "(--checkpoint-dir FIRST/checkpoints) with the same population settings")
        have = [(x["measure"], x["rho"]) for x in r.get("sharpness", [])]
        new = [x for x in e.get("sharpness", []) if not any(
            m == x["measure"] and math.isclose(rho, x["rho"], rel_tol=1e-9) for m, rho in have)]
        added += len(new)
        merged.append({**r, "sharpness": list(r.get("sharpness", [])) + new})
    measures = list(dict.fromkeys(list(config.get("measures", []))
                                  + list(extra[0]["study_config"].get("measures", []))))
    log(f"{extra_src}: merged {added} sharpness values of {len(by_id)} models")
    return merged, {**config, "measures": measures}


def check_one_commit(records: Sequence[Dict[str, Any]], where: str, *,
                     allow_mixed: bool = False) -> Dict[str, int]:
    """:func:`~quotient_manifolds.experiments.provenance.commits_of` of ``records``; raises
    :class:`~quotient_manifolds.experiments.runner.ExperimentError` when they were written by more
    than one version of the code (records without a commit count as one more) and
    ``allow_mixed`` is False: one statistic would pool numbers of two codes unseen."""
    commits = commits_of(records)
    if len(commits) > 1 and not allow_mixed:
        shown = ", ".join(f"{c[:12] + ('+dirty' if c.endswith('+dirty') else '') if len(c) >= 40 else c}"
                          f": {n} records" for c, n in commits.items())
        raise ExperimentError(
            f"{where} holds records written by {len(commits)} versions of the code ({shown}). "
            f"Pooling them would put numbers of different code into one statistic. Rerun the "
            f"older models with the current code (into a new --out), or pass "
            f"--allow-mixed-commits to report them together anyway (the summary lists every "
            f"commit).")
    return commits


def report_from_results(path: str, out_dir: Optional[str] = None, *, n_boot: int = 2000,
                        config_hash: Optional[str] = None, target: Optional[str] = None,
                        extra: Sequence[str] = (), allow_mixed_commits: bool = False,
                        log=print) -> Dict[str, Any]:
    """Recompute a study's summary from ``results.jsonl`` and say which code wrote it: the
    records must come from one commit (:func:`check_one_commit`; ``allow_mixed_commits`` pools
    several), and summary.md / summary.json end with their provenance
    (:func:`~quotient_manifolds.experiments.reporting.stamp_provenance`). The rest:
    :func:`_summary_of`."""
    src = _results_file(path)
    chosen, records, hashes = _records_of_one_config(src, config_hash)
    pooled = list(records)
    for extra_path in extra:
        pooled += _records_of_one_config(_results_file(extra_path))[1]
    check_one_commit(pooled, src + "".join(f" with {e}" for e in extra),
                     allow_mixed=allow_mixed_commits)
    summary = _summary_of(src, chosen, records, hashes, out_dir, n_boot=n_boot, target=target,
                          extra=extra, log=log)
    stamp_provenance(out_dir or os.path.dirname(os.path.abspath(src)), pooled, summary)
    return summary


def _summary_of(src: str, chosen: str, records: List[Dict[str, Any]], hashes: List[str],
                out_dir: Optional[str], *, n_boot: int, target: Optional[str],
                extra: Sequence[str], log) -> Dict[str, Any]:
    """A study's summary from the records of configuration ``chosen`` of ``src`` (``hashes``: all
    configurations present).

    Diagonal: :func:`diagonal_report`. Text / vision populations: :func:`population_report` with
    :func:`population_kwargs` of the records' configuration, the study's ``exclusions`` and, when
    the directory holds one for the same configuration, ``calibration.json``; the target is
    ``target``, else the one of the directory's summary.json, else the study's default. ``extra``:
    results of second passes over the same models (:func:`merge_second_pass`)."""
    study = records[0].get("study")
    kind = STUDY[study].report if study in STUDY else None
    src_dir = os.path.dirname(os.path.abspath(src))
    out_dir = out_dir or src_dir
    if kind == "own":  # the study's own report, from the records alone
        if extra:
            raise ExperimentError(f"--extra merges second passes of the text / vision "
                                  f"populations; the {study} study has none")
        os.makedirs(out_dir, exist_ok=True)
        return STUDY[study].own_report()(out_dir, records[0]["study_config"], chosen, records, source=src)
    if kind is None:
        reported = [n for n, s in STUDY.items() if s.report is not None]
        raise ExperimentError(f"`report` recomputes the {', '.join(reported[:-1])} and {reported[-1]} "
                              f"studies' summaries; {src} holds the {study!r} study (its "
                              f"summary is written by its own run)")
    os.makedirs(out_dir, exist_ok=True)
    if len(hashes) > 1:
        log(f"{src}: {len(hashes)} configurations; using {chosen} ({len(records)} models)")
    if kind == "diagonal":
        if extra:
            raise ExperimentError("--extra merges second passes of the text / vision "
                                  "populations; the diagonal study has none")
        return diagonal_report(out_dir, records[0]["study_config"], chosen, records,
                               exclude=STUDY[study].load().exclusions(records), n_boot=n_boot, source=src)
    mod = STUDY[study].load()
    if target is None:
        try:
            with open(os.path.join(src_dir, "summary.json")) as fh:
                old = json.load(fh)
            target = old.get("target") if old.get("config_hash") == chosen else None
        except (OSError, ValueError):
            target = None
    target = target or STUDY[study].target
    config = records[0]["study_config"]
    for extra_path in extra:
        records, config = merge_second_pass(records, config, _results_file(extra_path), log=log)
    cal = calibrate.load(src_dir)
    if cal is not None and cal.get("config_hash") != chosen:
        cal = None
    kwargs = population_kwargs(study, config, target)
    exclude = getattr(mod, "exclusions", lambda recs: {})(records)
    return population_report(out_dir, study, config, chosen, records, exclude=exclude,
                             calibration=cal, n_boot=n_boot, source=src,
                             second_passes=[os.path.relpath(os.path.dirname(os.path.abspath(
                                 _results_file(e))), src_dir) for e in extra], **kwargs)


# ------------------------------------------------------------------------------------ two studies
#: the metrics :func:`same_models` compares model by model
JOINED_METRICS = ("own_train_loss", "own_train_error", "test_error", "gap_own")


def same_models(path: str, other: str) -> Dict[str, Any]:
    """Are the records of two studies (e.g. ``matched`` and ``vision``) of the same models?

    Joins the two results files by model id (the configuration of each file's last line) and
    returns: ``models`` (ids in both), ``same_hparams`` (seed and hyperparameters equal),
    ``same_checkpoint_name``, ``same_pretrained`` (models whose pretrained starting point has the
    same recorded errors in both, where there is one), ``weights`` (of the ids whose records both
    carry ``weights_sha256``, how many match), and per metric of :data:`JOINED_METRICS` how many models differ, the
    largest |difference| and Kendall τ-b of the metric between the two studies.

    Raises
    ------
    ExperimentError
        if the two files share no model id.
    """
    a = {r["model_id"]: r for r in _records_of_one_config(_results_file(path))[1]}
    b = {r["model_id"]: r for r in _records_of_one_config(_results_file(other))[1]}
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ExperimentError(f"{path} and {other} share no model id: nothing to join")
    hashed = [i for i in ids if a[i].get("weights_sha256") and b[i].get("weights_sha256")]
    out: Dict[str, Any] = dict(
        models=len(ids),
        same_hparams=sum(a[i].get("seed") == b[i].get("seed")
                         and a[i].get("hparams") == b[i].get("hparams") for i in ids),
        same_checkpoint_name=sum(a[i].get("checkpoint") == b[i].get("checkpoint") for i in ids),
        # the pretrained model's record (vision fine-tunes): its errors, to the last digit
        same_pretrained=sum(_pretrained(a[i]) == _pretrained(b[i]) for i in ids
                            if _pretrained(a[i]) is not None),
        weights=dict(both_hashed=len(hashed),
                     equal=sum(a[i]["weights_sha256"] == b[i]["weights_sha256"] for i in hashed)),
        metrics={})
    for key in JOINED_METRICS:
        x = [float(a[i]["metrics"][key]) for i in ids]
        y = [float(b[i]["metrics"][key]) for i in ids]
        diff = [abs(p - q) for p, q in zip(x, y)]
        out["metrics"][key] = dict(differ=sum(d > 0 for d in diff), max_abs_diff=max(diff),
                                   tau_b=float(kendall_tau_b(x, y)))
    return out


def _pretrained(record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    return (record.get("train_info") or {}).get("pretrained")


def same_models_lines(path: str, other: str, joined: Dict[str, Any]) -> List[str]:
    """:func:`same_models`'s answer as lines for the log."""
    n, w = joined["models"], joined["weights"]
    lines = [f"{path} vs {other}: {n} models in both; the same seed and hyperparameters: "
             f"{joined['same_hparams']}; the same checkpoint name: {joined['same_checkpoint_name']}; "
             f"the same pretrained model's errors: {joined['same_pretrained']}; "
             + (f"the same weights (weights_sha256): {w['equal']} of {w['both_hashed']} hashed in "
                f"both" if w["both_hashed"] else "weights: no model hashed in both (records "
                                                 "before weights_sha256)")]
    for key, d in joined["metrics"].items():
        lines.append(f"  {key}: differs on {d['differ']} of {n} models, by up to "
                     f"{d['max_abs_diff']:.4g}; τ-b between the two studies {d['tau_b']:+.2f}")
    return lines
