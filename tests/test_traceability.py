"""Every record traceable to its code and weights; training repeatable bit for bit; `report`
refuses to pool records of two commits unless told to."""

import json
import os
import shutil
import subprocess

import pytest
import torch

from quotient_manifolds.experiments import vision as V
from quotient_manifolds.experiments.cli import main
from quotient_manifolds.experiments.provenance import (
    UNRECORDED, commits_of, provenance, provenance_label, reproducible_training, weights_hash)
from quotient_manifolds.experiments.checkpoints import load_checkpoint, trained_model
from quotient_manifolds.experiments.runner import OutputDir, ResultStore, _line_digest, run_population

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------ weights_hash
def test_weights_hash_is_stable_and_sees_every_bit():
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    h = weights_hash(state)
    assert weights_hash(dict(reversed(list(state.items())))) == h          # order of the dict
    flipped = state["w"].clone()
    flipped.view(torch.int32)[0, 0] ^= 1                                     # one bit
    assert weights_hash({**state, "w": flipped}) != h
    assert weights_hash({**state, "w": state["w"].double()}) != h           # dtype
    assert weights_hash({**state, "w": state["w"].reshape(3, 2)}) != h      # shape
    assert weights_hash({"v": state["w"], "b": state["b"]}) != h            # name
    assert weights_hash({**state, "w": state["w"].t().contiguous().t()}) == h  # layout is not content
    assert len(weights_hash({"x": torch.ones(2, dtype=torch.bfloat16)})) == 64
    with pytest.raises(TypeError, match="not a tensor"):
        weights_hash({"w": [1.0]})


def test_weights_hash_has_a_fixed_value():
    """The hash is a function of the weights alone, the same in every release (a changed function
    would make new records unjoinable with old ones): SHA-256 over name, dtype, shape and bytes,
    here written out with hashlib and numpy, and as a literal."""
    import hashlib
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    h = hashlib.sha256()
    for name in ("b", "w"):
        t = state[name]
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode() + t.numpy().tobytes())
    assert weights_hash(state) == h.hexdigest() == (
        "a5e3d1882af249f3b4482a122a1dfe116f0b0957000bb52a2864c0a066d684e4")


# ------------------------------------------------------------------------------ reproducible
_ARCH = {"arch": dict(width=32, depth=2, heads=2, patch=7, mlp_ratio=2.0)}
_HP = dict(seed=3, lr=2e-3, weight_decay=0.05, batch_size=256, epochs=2, augment="flip",
           label_smoothing=0.1)


def _retrain(ckpt_dir, outer_threads: int, seed: int = 3):
    """A tiny ViT fine-tuned by the vision study's own `fit`, through the runner's
    `trained_model` (the path of every text and vision model), with torch at `outer_threads`."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (512,), generator=g)
    hp = dict(_HP, seed=seed)
    before = torch.get_num_threads()
    torch.set_num_threads(outer_threads)
    try:
        model, info = trained_model(
            "tiny", 0, "h" * 16, str(ckpt_dir), hp=hp, build=lambda: V.build_model(_ARCH, seed),
            train=lambda m: V.fit(m, x, y, hp, 0.05), restore=lambda m, t: False,
            stored_state=lambda m: m.state_dict())
    finally:
        torch.set_num_threads(before)
    return model, info


def test_retraining_a_tiny_vit_twice_gives_the_same_weights(tmp_path):
    """Trained twice from its seed, with torch at 1 and then 2 threads (a sum split over two
    threads adds in another order: without fixed threads these weights differ in the last bits),
    the model's weights are the same bit for bit; the record's hash is that of the checkpoint."""
    m1, first = _retrain(tmp_path / "a", outer_threads=1)
    m2, second = _retrain(tmp_path / "b", outer_threads=2)
    assert first["weights_sha256"] == second["weights_sha256"] == weights_hash(m1.state_dict())
    assert first["train"]["reproducible"] == {"threads": 1, "deterministic": True}
    (ckpt,) = os.listdir(tmp_path / "a")
    tensors, _ = load_checkpoint(str(tmp_path / "a" / ckpt))
    assert weights_hash(tensors) == first["weights_sha256"]
    _, other = _retrain(tmp_path / "c", outer_threads=1, seed=4)
    assert other["weights_sha256"] != first["weights_sha256"]


def test_reproducible_training_restores_torch_settings():
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    with reproducible_training(1) as how:
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
        assert how == {"threads": 1, "deterministic": True}
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            with reproducible_training(bad):
                pass


# ------------------------------------------------------------------------------ records
def _job(model_id):
    return {"value": float(model_id)}


def test_every_record_carries_the_commit_and_the_versions(tmp_path):
    with OutputDir(str(tmp_path), "toy", {"a": 1}) as od:
        records, failed = run_population(od, _job, range(2), (), progress=False,
                                         log=lambda m: None)
    assert not failed
    for r in records:
        p = r["provenance"]
        assert p["torch"] == torch.__version__ and p["python"] and p["version"]
        assert set(p) >= {"commit", "dirty", "transformers", "numpy", "cpu"}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:            # a git checkout: the commit of the code that ran
        assert records[0]["provenance"]["commit"] == head.stdout.strip() == provenance()["commit"]
    on_disk, _ = ResultStore(os.path.join(tmp_path, "results.jsonl")).load()
    assert on_disk[0]["provenance"] == records[0]["provenance"]


# ------------------------------------------------------------------------------ report
def _with_commits(src_dir, dst_dir, commit_of_line):
    """A copy of a committed study directory whose i-th record says it was written by
    ``commit_of_line(i)`` (None: no provenance, as records before it), each line re-signed."""
    shutil.copytree(src_dir, dst_dir)
    path = os.path.join(dst_dir, "results.jsonl")
    lines = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            r = json.loads(line)
            commit = commit_of_line(i)
            if commit is not None:
                r["provenance"] = dict(provenance(), commit=commit, dirty=False)
            r.pop("_sha256")
            r["_sha256"] = _line_digest(r)
            lines.append(json.dumps(r) + "\n")
    with open(path, "w") as fh:
        fh.writelines(lines)
    return path


def test_report_refuses_records_of_two_commits_unless_told(tmp_path, capsys):
    src = os.path.join(REPO, "experiments", "results", "lora")
    run = tmp_path / "lora"
    _with_commits(src, run, lambda i: "a" * 40 if i % 2 else "b" * 40)
    assert main(["report", str(run), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "2 versions of the code" in err and "aaaaaaaaaaaa" in err and "bbbbbbbbbbbb" in err
    assert "--allow-mixed-commits" in err and not (tmp_path / "x" / "summary.md").exists()
    assert main(["report", str(run), "--out", str(tmp_path / "y"), "--allow-mixed-commits"]) == 0
    summary = json.loads((tmp_path / "y" / "summary.json").read_text())
    assert set(summary["provenance"]["commits"]) == {"a" * 40, "b" * 40}
    md = (tmp_path / "y" / "summary.md").read_text()
    assert "## Provenance" in md and "from commit aaaaaaaaaaaa" in md and "bbbbbbbbbbbb" in md
    # records of a commit beside records written before provenance: two codes, refused too
    _with_commits(src, tmp_path / "old-and-new", lambda i: "a" * 40 if i % 2 else None)
    assert main(["report", str(tmp_path / "old-and-new"), "--out", str(tmp_path / "z")]) == 2
    assert f"{UNRECORDED}: " in capsys.readouterr().err


def test_report_labels_records_without_a_commit(tmp_path):
    src = os.path.join(REPO, "experiments", "results", "lora")
    assert main(["report", src, "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    n = summary["provenance"]["commits"][UNRECORDED]
    assert n > 0 and f"{n} record(s) without a recorded commit" in (tmp_path / "summary.md").read_text()


def test_provenance_label_names_commit_versions_and_hashes():
    p = dict(provenance(), commit="c" * 40, dirty=True)
    records = [{"provenance": p, "weights_sha256": "0" * 64}, {}]
    assert commits_of(records) == {"c" * 40 + "+dirty": 1, UNRECORDED: 1}
    label = provenance_label(records)
    assert "from commit cccccccccccc (with uncommitted changes)" in label
    assert f"torch {torch.__version__}" in label and "1 of 2 with the SHA-256" in label
    assert "1 record(s) without a recorded commit" in label


def test_report_warns_when_it_drops_a_duplicated_line(tmp_path, capsys):
    src = os.path.join(REPO, "experiments", "results", "lora")
    run = tmp_path / "lora"
    shutil.copytree(src, run)
    lines = (run / "results.jsonl").read_bytes().splitlines(True)
    (run / "results.jsonl").write_bytes(b"".join(lines + [lines[3], lines[3]]))
    assert main(["report", str(run), "--out", str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and err.count("2 earlier line(s) dropped") == 1


# ------------------------------------------------------------------------------ two studies
def test_same_models_joins_two_studies_and_sees_retrained_models(capsys):
    """The committed matched and vision studies: the same seeds, hyperparameters and checkpoint
    names, but retrained (another pretrained model; metrics differ), as docs/results.md says."""
    from quotient_manifolds.experiments.report import same_models
    a, b = (os.path.join(REPO, "experiments", "results", s) for s in ("matched", "vision-finetune"))
    got = same_models(a, b)
    assert got["models"] == got["same_hparams"] == got["same_checkpoint_name"] == 48
    assert got["same_pretrained"] == 0 and got["weights"]["both_hashed"] == 0
    assert got["metrics"]["own_train_loss"]["differ"] == 48
    assert got["metrics"]["test_error"]["differ"] == 46
    assert got["metrics"]["test_error"]["max_abs_diff"] == pytest.approx(0.0073, abs=1e-12)
    assert round(got["metrics"]["gap_own"]["tau_b"], 2) == 0.78
    assert main(["report", a, "--same-models", b]) == 0
    out = capsys.readouterr().out
    assert "test_error: differs on 46 of 48 models, by up to 0.0073" in out


def test_same_models_compares_weights_hashes(tmp_path):
    from quotient_manifolds.experiments.report import same_models
    for name, hashes in (("a", ["0" * 64, "1" * 64]), ("b", ["0" * 64, "2" * 64])):
        store = ResultStore(str(tmp_path / name / "results.jsonl"))
        os.makedirs(tmp_path / name)
        for i, h in enumerate(hashes):
            store.append({"model_id": i, "config_hash": "c", "seed": i, "hparams": {},
                          "weights_sha256": h, "metrics": {k: 0.1 * i for k in (
                              "own_train_loss", "own_train_error", "test_error", "gap_own")}})
    got = same_models(str(tmp_path / "a"), str(tmp_path / "b"))
    assert got["weights"] == {"both_hashed": 2, "equal": 1}
    assert got["metrics"]["gap_own"]["differ"] == 0


def test_git_commit_outside_a_checkout_and_bad_weights(tmp_path):
    """No commit is claimed for code git does not track: a directory outside any checkout, or a
    copy of the package lying untracked inside someone else's repository (a virtual environment
    in a project); and weights_hash refuses what is not a state dict."""
    import importlib.util

    from quotient_manifolds.experiments import provenance as P
    assert P.git_commit(str(tmp_path)) == (None, None)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    if subprocess.run(git + ["init", "-q"]).returncode != 0:
        pytest.skip("git is not installed")
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "theirs"], check=True)
    copy = tmp_path / "site-packages" / "provenance_copy.py"
    copy.parent.mkdir()
    shutil.copy(P.__file__, copy)
    spec = importlib.util.spec_from_file_location("provenance_copy", copy)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.git_commit() == (None, None)
    with pytest.raises(TypeError, match="state dict"):
        weights_hash(torch.nn.Linear(2, 2))
