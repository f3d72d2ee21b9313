"""``quotient-manifolds sharpness CHECKPOINT_DIR`` (adapters.checkpoint): a classifier and a causal LM
saved by the test (tiny models from a config, a word-level tokenizer built offline) measured on
JSONL / CSV / save_to_disk data; the values are those of adapters.sharpness on the same batches;
bad inputs give one-line errors."""

from __future__ import annotations

import csv
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from quotient_manifolds import adapters  # noqa: E402
from quotient_manifolds.adapters.checkpoint import checkpoint_sharpness  # noqa: E402
from quotient_manifolds.errors import CheckpointError, InvalidArgumentType  # noqa: E402
from quotient_manifolds.experiments.cli import main  # noqa: E402

WORDS = "good bad fine awful great poor nice dull film plot actors the a was and very".split()
ROWS = [{"text": f"the film was {w} and {v}", "label": int(w in ('good', 'fine', 'great', 'nice'))}
        for w, v in zip(WORDS[:8], reversed(WORDS[:8]))]


def _tokenizer():
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[PAD]")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: checkpoint directory} of a tiny BERT classifier and a tiny GPT-2, with the tokenizer."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    models = {
        "classifier": transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=len(WORDS) + 2, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=32, num_labels=2, initializer_range=0.3)),
        "lm": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=len(WORDS) + 2, n_embd=16, n_layer=1, n_head=2, n_positions=32, initializer_range=0.3)),
    }
    out = {}
    for name, model in models.items():
        model.double().save_pretrained(root / name)
        _tokenizer().save_pretrained(root / name)
        out[name] = str(root / name)
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out["jsonl"] = str(data)
    with open(root / "rows.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["text", "label"])
        writer.writeheader()
        writer.writerows(ROWS)
    out["csv"] = str(root / "rows.csv")
    return out


def _direct(path, geometry, rho, task):
    """adapters.sharpness of the checkpoint on the same two batches of four rows, built here."""
    tok = _tokenizer()
    auto = (transformers.AutoModelForSequenceClassification if task == "cls" else transformers.AutoModelForCausalLM)
    model = auto.from_pretrained(path).eval()
    batches = []
    for start in (0, 4):
        enc = tok([r["text"] for r in ROWS[start:start + 4]], padding=True, return_tensors="pt")
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        batch["labels"] = (torch.tensor([r["label"] for r in ROWS[start:start + 4]]) if task == "cls"
                           else enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100))
        batches.append(batch)
    return adapters.sharpness(model, batches, geometry=geometry, rho=rho, n_iters=3).value


def test_the_cli_measures_a_saved_classifier_as_a_direct_call_does(saved, capsys, tmp_path):
    code = main(["sharpness", saved["classifier"], "--data", saved["jsonl"], "--rho", "0.1", "--n-iters", "3",
                 "--batches", "2", "--batch-size", "4", "--geometry", "geodesic-inv", "--geometry", "adaptive",
                 "--no-progress"])
    out = capsys.readouterr()
    assert code == 0
    result = json.loads(out.out)                            # stdout holds only the JSON
    assert result["task"] == "sequence-classification" and result["n_examples"] == 8
    assert list(result["results"]) == ["geodesic-inv", "adaptive"]
    assert "geodesic-inv" in out.err and "sharpness" in out.err    # the table, on stderr
    for geometry in ("geodesic-inv", "adaptive"):
        assert abs(result["results"][geometry]["sharpness"] - _direct(saved["classifier"], geometry, 0.1, "cls")) <= 1e-10


def test_a_causal_lm_from_csv_with_a_calibrated_rho_written_to_a_file(saved, capsys, tmp_path):
    out_file = tmp_path / "result.json"
    code = main(["sharpness", saved["lm"], "--data", saved["csv"], "--target-loss-rise", "0.05", "--n-iters", "3",
                 "--batches", "2", "--batch-size", "4", "--geometry", "geodesic-inv", "--out", str(out_file),
                 "--no-progress"])
    assert code == 0
    result = json.loads(out_file.read_text())
    assert result["task"] == "causal-lm"
    res = result["results"]["geodesic-inv"]
    assert res["calibration"]["target_loss_rise"] == 0.05 and res["calibration"]["evals"]
    assert abs(res["sharpness"] - _direct(saved["lm"], "geodesic-inv", res["rho"], "lm")) <= 1e-10
    assert "geodesic-inv" in capsys.readouterr().out           # the table, on stdout


def test_a_datasets_directory(saved, tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "ds"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(path))
    res = checkpoint_sharpness(saved["classifier"], str(path), geometries=["adaptive"], rho=0.1, n_iters=3,
                               batches=2, batch_size=4)
    assert abs(res.results["adaptive"]["sharpness"] - _direct(saved["classifier"], "adaptive", 0.1, "cls")) <= 1e-10


def test_bad_inputs_give_one_line_errors(saved, capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [
        ([str(tmp_path), "--data", saved["jsonl"]], "no Hugging Face model in"),
        ([saved["classifier"], "--data", saved["jsonl"], "--text-column", "sentence"], "has no column 'sentence'"),
        ([saved["classifier"], "--data", str(empty)], "is empty"),
        ([saved["classifier"], "--data", str(tmp_path / "missing.jsonl")], "does not exist"),
        ([saved["classifier"], "--data", saved["jsonl"], "--device", "gpu0"], "unknown device"),
    ]
    for args, message in cases:
        code = main(["sharpness", *args, "--rho", "0.1", "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("error: ") and message in err[-1], (args, err)
    bad_label = tmp_path / "bad.jsonl"
    bad_label.write_text(json.dumps({"text": "good film", "label": 7}) + "\n")
    with pytest.raises(CheckpointError, match="outside the checkpoint's 2 classes"):
        checkpoint_sharpness(saved["classifier"], str(bad_label), rho=0.1)
    with pytest.raises(InvalidArgumentType, match="unexpected keyword"):       # before the model is loaded
        checkpoint_sharpness(str(tmp_path), saved["jsonl"], rho=0.1, n_iter=3)
    with pytest.raises(SystemExit):     # --rho or --target-loss-rise is required (argparse)
        main(["sharpness", saved["classifier"], "--data", saved["jsonl"]])
