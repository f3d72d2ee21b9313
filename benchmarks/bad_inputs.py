"""Re-measure the bad-input cases of the public API: one call per case, classified as

* ``clear``: a ValueError / TypeError / FloatingPointError whose message contains the words that say
  what was wrong (the argument or the cause), with the model unchanged;
* ``right``: a correct, finite answer where one exists (e.g. integer arrays in the pymanopt face,
  converted exactly);
* ``silent wrong``: no error where one was due, or a wrong / non-finite number;
* ``unhelpful``: an error that does not say what was wrong, or of another type;
* ``corrupts``: the user's model changed.

Tiny models from configs (float64, BERT unless the case needs another), so it runs in about a minute
on CPU; the worker-exit case is in tests/test_worker_exit.py (it needs a process to kill).

    python benchmarks/bad_inputs.py
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import warnings
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transformers  # noqa: E402

from quotient_manifolds import adapters  # noqa: E402
from quotient_manifolds.adapters.detection import layout as detect_layout  # noqa: E402

torch.set_num_threads(1)
CLEAR_TYPES = (ValueError, TypeError, FloatingPointError)


def bert(heads: int = 2, **extra):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=heads,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2, **extra)
    model = transformers.BertForSequenceClassification(cfg).double().eval()
    ids = torch.randint(0, 50, (2, 6))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def batches(inputs):
    return [(inputs, torch.tensor([0, 1]))]


def ce(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.logits, targets)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(model, snap) -> bool:
    now = model.state_dict()
    return set(now) == set(snap) and all(torch.equal(now[k], v) for k, v in snap.items())


# ----------------------------------------------------------------------------------------- cases
def case_average_nan_loss():
    m, x = bert()
    nan = lambda o, y: ce(o, y) * torch.tensor(math.nan)  # noqa: E731
    return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, measure="average", n_samples=2,
                                         loss_fn=nan), ["not finite"]


def case_tuple_output():
    class FeaturesAndLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            f = torch.tanh(self.body(x))
            return f, self.head(f)

    torch.manual_seed(0)
    m = FeaturesAndLogits()
    return m, lambda: adapters.sharpness(m, [(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))], rho=0.1,
                                         geometry="adaptive", n_iters=1), ["loss_fn"]


def case_step_size_mult(value):
    def make():
        m, x = bert()
        return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, step_size_mult=value), \
            ["step_size_mult"]
    return make


def case_include_frozen_layout():
    m, x = bert()
    m.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    lay = detect_layout(m)
    return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, layout=lay,
                                         include_frozen=True), ["include_frozen"]


def case_verify_empty_scales():
    m, x = bert()
    return m, lambda: detect_layout(m).verify(m, x, scales=()), ["scales"]


def case_layout_of_other_heads():
    m, x = bert(heads=2)
    other, _ = bert(heads=4)
    lay = detect_layout(other)
    return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, layout=lay), ["layout"]


def case_glquotient_integer():
    from quotient_manifolds.geoopt import GLQuotient
    M = GLQuotient(5, 4, 2, metric="inv")
    x = M.random(9, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return None, lambda: M.inner(x, torch.ones(9, 2, dtype=torch.int64)), ["floating-point"]


def case_pymanopt_integer():
    from quotient_manifolds.pymanopt import GLQuotient
    M = GLQuotient(5, 4, 2, metric="inv")
    np.random.seed(0)
    x = M.random_point()
    ints = (np.ones((5, 2), dtype=int), np.ones((4, 2), dtype=int))
    floats = (np.ones((5, 2)), np.ones((4, 2)))
    right = M.inner_product(x, floats, floats)
    return None, lambda: M.inner_product(x, ints, ints), ("right", right)


def case_sam_nan_grad():
    m, x = bert()
    opt = adapters.GeodesicSAM(m, torch.optim.SGD, lr=0.1, rho=0.05, geometry="geodesic-inv")
    m(**x).logits.sum().backward()
    m.bert.encoder.layer[0].attention.self.query.weight.grad[0, 0] = math.nan
    return m, opt.first_step, ["non-finite"]


def case_report_corrupt_middle_line():
    from quotient_manifolds.experiments.report import read_records
    from quotient_manifolds.experiments.runner import ResultStore
    d = tempfile.mkdtemp()
    path = os.path.join(d, "results.jsonl")
    store = ResultStore(path)
    for i in range(3):
        store.append({"model_id": i})
    lines = open(path).read().splitlines(True)
    lines[1] = lines[1].replace('"model_id":1', '"model_id":7')
    open(path, "w").write("".join(lines))
    from quotient_manifolds.experiments.runner import ExperimentError
    return None, lambda: _as_value_error(ExperimentError, lambda: read_records(path)), ["corrupt"]


def _as_value_error(kind, call):
    try:
        return call()
    except kind as err:
        raise ValueError(str(err)) from None


def case_loss(loss_fn, words):
    def make():
        m, x = bert()
        return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, loss_fn=loss_fn), words
    return make


def case_hessian_vector_loss():
    from quotient_manifolds.adapters.hessian import riemannian_hessian
    m, x = bert()
    vec = lambda o, y: torch.nn.functional.cross_entropy(o.logits, y, reduction="none")  # noqa: E731
    return m, lambda: riemannian_hessian(m, batches(x), geometry="geodesic-inv", loss_fn=vec), ["one number"]


def case_n_samples_zero():
    m, x = bert()
    return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, measure="average", n_samples=0), ["n_samples"]


def case_batch_size_fn_zero():
    from quotient_manifolds.adapters.hessian import riemannian_hessian
    m, x = bert()

    def call():
        op = riemannian_hessian(m, batches(x), geometry="geodesic-inv", batch_size_fn=lambda inputs: 0)
        return op @ torch.ones(op.shape[1], dtype=torch.float64)
    return m, call, ["batch_size_fn"]


def case_meta_model():
    with torch.device("meta"):
        m, _ = bert()
    ids = torch.randint(0, 50, (2, 6))
    return None, lambda: adapters.sharpness(m, [({"input_ids": ids}, torch.tensor([0, 1]))], rho=0.1,
                                            n_iters=1), ["meta"]


def case_kinked_loss():
    def kinked(o, y):
        return ce(o, y) + torch.sqrt(o.logits - o.logits.detach()).sum()
    m, x = bert()
    return m, lambda: _not_reduce_rho(lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1,
                                                                 loss_fn=kinked)), ["gradient"]


def _not_reduce_rho(call):
    try:
        return call()
    except Exception as err:
        if "reduce rho" in str(err):
            raise RuntimeError(f"blamed on rho: {err}") from None
        raise


def case_step_size_mult_nan():
    m, x = bert()
    return m, lambda: _not_reduce_rho(lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1,
                                                                 step_size_mult=math.nan)), ["step_size_mult"]


def case_verify_cond_nan():
    m, x = bert()
    return m, lambda: detect_layout(m).verify(m, x, cond=math.nan), ["cond"]


def case_layout_other_model_sizes():
    m, x = bert(heads=2)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    other = transformers.BertForSequenceClassification(cfg).double()
    lay = detect_layout(other)
    return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, layout=lay), ["layout"]


def case_layout_other_model_names():
    m, x = bert()
    torch.manual_seed(0)
    other = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                                 n_positions=16)).double()
    lay = detect_layout(other)
    return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, layout=lay), ["layout"]


def case_glquotient_batch_shapes():
    from quotient_manifolds.geoopt import GLQuotient
    M = GLQuotient(5, 4, 2, metric="inv")
    x = M.random(3, 9, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return None, lambda: M.inner(x, torch.ones(4, 9, 2, dtype=torch.float64)), ["u has shape"]


def case_input_ids_shape():
    m, _ = bert()
    ids = torch.randint(0, 50, (2, 6, 3))
    return m, lambda: adapters.sharpness(m, [({"input_ids": ids}, torch.tensor([0, 1]))], rho=0.1,
                                         n_iters=1), ["input"]


def case_head_dim_larger_than_hidden():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=16)
    m = transformers.LlamaForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 50, (2, 6))
    return m, lambda: adapters.sharpness(m, [{"input_ids": ids, "labels": ids}], rho=0.1, n_iters=1), \
        ["self_attn/qk"]


CASES: List[Tuple[str, str, Callable]] = [
    # (what the issue found, case, maker)
    ("silent wrong", "measure='average' with a NaN loss", case_average_nan_loss),
    ("silent wrong", "tuple output (features, logits)", case_tuple_output),
    ("silent wrong", "step_size_mult=0", case_step_size_mult(0.0)),
    ("silent wrong", "step_size_mult=-1", case_step_size_mult(-1.0)),
    ("silent wrong", "include_frozen=True with a layout built without it", case_include_frozen_layout),
    ("silent wrong", "verify(scales=())", case_verify_empty_scales),
    ("silent wrong", "layout of a 4-head BERT on a 2-head BERT", case_layout_of_other_heads),
    ("silent wrong", "geoopt GLQuotient.inner with an integer tangent", case_glquotient_integer),
    ("silent wrong", "pymanopt GLQuotient.inner_product with integer arrays", case_pymanopt_integer),
    ("silent wrong", "report: corrupt middle line of results.jsonl", case_report_corrupt_middle_line),
    ("corrupts", "GeodesicSAM.first_step with a NaN in .grad", case_sam_nan_grad),
    ("crash", "vector loss", case_loss(lambda o, y: torch.nn.functional.cross_entropy(o.logits, y, reduction="none"),
                                       ["one number"])),
    ("crash", "Python float loss", case_loss(lambda o, y: float(ce(o, y).detach()), ["tensor"])),
    ("crash", "constant loss", case_loss(lambda o, y: torch.tensor(1.0), ["does not depend"])),
    ("crash", "vector loss in riemannian_hessian", case_hessian_vector_loss),
    ("crash", "n_samples=0", case_n_samples_zero),
    ("crash", "batch_size_fn returning 0", case_batch_size_fn_zero),
    ("crash", "meta-device model", case_meta_model),
    ("crash", "step_size_mult=nan (was 'reduce rho')", case_step_size_mult_nan),
    ("crash", "finite loss, NaN gradient (was 'reduce rho')", case_kinked_loss),
    ("crash", "verify(cond=nan)", case_verify_cond_nan),
    ("crash", "layout from another model: other sizes", case_layout_other_model_sizes),
    ("crash", "layout from another model: other names (KeyError)", case_layout_other_model_names),
    ("crash", "GLQuotient mismatched batch shapes", case_glquotient_batch_shapes),
    ("crash", "wrong-shaped input ids", case_input_ids_shape),
    ("crash", "head dim larger than hidden size (refused later, naming no block)", case_head_dim_larger_than_hidden),
]


def classify(make) -> Tuple[str, str]:
    try:
        model, call, expect = make()
    except Exception as err:  # noqa: BLE001 - the set-up itself refused (e.g. an unsupported config)
        return ("clear" if isinstance(err, CLEAR_TYPES) else "unhelpful"), f"set-up: {type(err).__name__}: {err}"
    snap = snapshot(model) if model is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = call()
            err = None
        except Exception as e:  # noqa: BLE001
            err = e
    if snap is not None and not unchanged(model, snap):
        return "corrupts", f"{type(err).__name__ if err else 'returned'}; the model changed"
    if isinstance(expect, tuple):            # a right answer exists
        if err is None and math.isclose(float(result), float(expect[1]), rel_tol=1e-12):
            return "right", f"{float(result)!r}"
        return ("silent wrong" if err is None else "unhelpful"), repr(err or result)
    if err is None:
        return "silent wrong", f"returned {getattr(result, 'value', result)!r}"
    said = f"{type(err).__name__}: {err}"
    if isinstance(err, CLEAR_TYPES) and any(w.lower() in str(err).lower() for w in expect):
        return "clear", said
    return "unhelpful", said


def main() -> None:
    rows: List[Dict[str, str]] = []
    for was, name, make in CASES:
        now, said = classify(make)
        rows.append({"was": was, "case": name, "now": now, "message": said.splitlines()[0][:160]})
        print(f"{now:13s} | was {was:12s} | {name} | {said.splitlines()[0][:120]}", flush=True)
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["now"]] = counts.get(r["now"], 0) + 1
    print("\n" + json.dumps(counts))


if __name__ == "__main__":
    main()
