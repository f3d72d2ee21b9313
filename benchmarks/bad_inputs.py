"""Re-measure the bad-input cases of the public API: one call per case, classified as

* ``clear``: a ValueError / TypeError / FloatingPointError whose message contains the words that say
  what was wrong (the argument or the cause), with the model unchanged;
* ``right``: a correct, finite answer where one exists (e.g. integer arrays in the pymanopt face,
  converted exactly);
* ``silent wrong``: no error where one was due, or a wrong / non-finite number;
* ``unhelpful``: an error that does not say what was wrong, or of another type;
* ``corrupts``: the user's model changed (its weights, buffers, requires_grad flags, ``.grad`` or
  train/eval flags).

A case where a warning is the right outcome (a worst-case run that found no rise) counts as clear
when the warning names what to do. Cases are grouped by root cause: the first round's (``round 1
(...)``, by what that round found), the second round's (the lower-level API, the CLI's records
and faults) and the third round's, marked ``(round 3)`` (verification on empty batches, checks
below the top door) and the fourth's, marked ``(round 4)`` (inputs the model's first layer cannot
take). The counts are printed per root cause and in total; ``python
benchmarks/bad_inputs.py WORD ...`` runs only the cases whose root cause or name contains one of
the words.

Tiny models from configs (float64, BERT unless the case needs another), so it runs in about half
a minute on CPU; the worker-exit case is in tests/test_worker_exit.py (it needs a process to kill).

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
    # (root cause, case, maker)
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


# ------------------------------------------------------------------------------- round 2 cases
# Each maker returns (model or None, call, expect): expect is a list of words a clear refusal
# names; ("right", value) where a right answer exists; ("warn", words) where a warning (or a
# refusal) naming the words is the right outcome.


def _gl_geometry():
    from quotient_manifolds.core.gl import GLQuotientGeometry
    geom = GLQuotientGeometry(5, 4, 2, "inv")
    x = geom.random_point(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return geom, x


def case_core_integer(method):
    def make():
        geom, x = _gl_geometry()
        u = torch.ones(9, 2, dtype=torch.int64)
        return None, lambda: getattr(geom, method)(x, u), ["floating"]
    return make


def case_rescaling_integer(method):
    def make():
        from quotient_manifolds.core.rescaling import RescalingGeometry
        geom = RescalingGeometry(3, "inv")
        x = torch.tensor([[1.0, 2.0, -1.5], [0.5, -1.0, 2.0]], dtype=torch.float64)
        return None, lambda: getattr(geom, method)(x, torch.ones(2, 3, dtype=torch.int32)), ["floating"]
    return make


def case_core_complex_tangent():
    geom, x = _gl_geometry()
    return None, lambda: geom.inner(x, torch.ones(9, 2, dtype=torch.complex128)), ["floating"]


def case_random_complex(face):
    def make():
        if face == "geoopt":
            from quotient_manifolds.geoopt import GLQuotient
            return None, lambda: GLQuotient(5, 4, 2).random(dtype=torch.complex64), ["dtype"]
        from quotient_manifolds.core.gl import GLQuotientGeometry
        return None, lambda: GLQuotientGeometry(5, 4, 2).random_point(dtype=torch.complex64), ["dtype"]
    return make


def case_random_integer_dtype():
    from quotient_manifolds.geoopt import GLQuotient
    return None, lambda: GLQuotient(5, 4, 2).random(dtype=torch.int64), ["dtype"]


def case_numpy_int_sizes(face):
    def make():
        if face == "geoopt":
            from quotient_manifolds.geoopt import GLQuotient as M
        elif face == "pymanopt":
            from quotient_manifolds.pymanopt import GLQuotient as M
        else:
            from quotient_manifolds.core.gl import GLQuotientGeometry as M
        return None, lambda: M(np.int64(5), np.int64(4), np.int64(2)).dim, ("right", (5 + 4) * 2 - 4)
    return make


def case_numpy_int_rescaling():
    from quotient_manifolds.core.rescaling import RescalingGeometry
    return None, lambda: RescalingGeometry(np.int64(3)).dim, ("right", 3)


def case_numpy_int_n_iters():
    m, x = bert()
    right = adapters.sharpness(m, batches(x), rho=0.1, n_iters=3, geometry="adaptive").value
    return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=np.int64(3),
                                         geometry="adaptive").value, ("right", right)


def case_float_size():
    from quotient_manifolds.core.gl import GLQuotientGeometry
    return None, lambda: GLQuotientGeometry(5.0, 4, 2), ["integer"]


def _low_level(geometry="adaptive"):
    """(model, batch closure pieces) for the low-level solver: a ball and a closure."""
    from quotient_manifolds.adapters.ball import build_ball
    from quotient_manifolds.adapters.evaluation import ModelClosure
    m, x = bert()
    params0 = {n: p.detach() for n, p in m.named_parameters()}
    lay = detect_layout(m) if geometry != "adaptive" else None
    ball, write_back = build_ball(m, params0, geometry=geometry, layout=lay)
    closure = ModelClosure(m, params0, {n: b for n, b in m.named_buffers()}, write_back, ce, False)
    closure.inputs, closure.targets = x, torch.tensor([0, 1])
    return m, ball, closure


def _case_solver(solve, defaults, value, **kw):
    """A case calling the low-level ``solve(ball, closure, rho, **defaults, **kw)`` (``rho``
    0.1 unless given) and reading the attribute ``value`` of its result."""
    words = [k for k in kw]

    def make():
        m, ball, closure = _low_level()
        args = {**defaults, **kw}
        rho = args.pop("rho", 0.1)
        return m, lambda: getattr(solve(ball, closure, rho, **args), value), words
    return make


def case_auto_pgd(**kw):
    return _case_solver(adapters.solver.auto_pgd, dict(n_iters=2), "worst_loss", **kw)


def case_average_case(**kw):
    return _case_solver(adapters.solver.average_case, dict(n_samples=2), "mean_loss", **kw)


def case_build_ball_no_layout():
    m, _ = bert()
    params0 = {n: p.detach() for n, p in m.named_parameters()}
    return m, lambda: adapters.ball.build_ball(m, params0, geometry="geodesic-inv"), ["layout"]


def case_random_actions(scale):
    def make():
        m, _ = bert()
        lay = detect_layout(m)
        return m, lambda: lay.random_actions(scale=scale), ["scale"]
    return make


def token_classifier(seq_len: int, num_labels: int):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=num_labels)
    model = transformers.BertForTokenClassification(cfg).double().eval()
    ids = torch.randint(0, 50, (2, seq_len))
    return model, ids, torch.randint(0, num_labels, (2, seq_len))


def case_default_loss_token(num_labels):
    def make():
        m, ids, y = token_classifier(6, num_labels)
        return m, lambda: adapters.sharpness(m, [({"input_ids": ids}, y)], rho=0.1, n_iters=1,
                                             geometry="adaptive"), ["loss_fn"]
    return make


def case_default_loss_causal_lm():
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                             n_positions=16)).double().eval()
    ids = torch.randint(0, 50, (2, 6))
    return m, lambda: adapters.sharpness(m, [(ids, ids)], rho=0.1, n_iters=1, geometry="adaptive"), \
        ["next_token_loss"]


def case_larger_ball(dtype, rho, smaller):
    """Sharpness at ``rho`` against ``smaller``: a larger ball that reports less (e.g. 0: the solver
    saturated) must say so (a warning or a refusal naming what to do)."""
    def make():
        m, x = bert()
        m = m.to(dtype)
        small = adapters.sharpness(m, batches(x), rho=smaller, geometry="adaptive", n_iters=10).value

        def call():
            value = adapters.sharpness(m, batches(x), rho=rho, geometry="adaptive", n_iters=10).value
            return 1.0 if value >= small else value      # "right" when it is not less
        return m, call, ("warn", ["step_size_mult", "sharpness_sweep"], 1.0)
    return make


def case_mlp_inputs(kind):
    """Inputs a float32 MLP's first layer cannot take: named with the batch, not torch's raw
    ``mat1 and mat2`` error from inside the model."""
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        x = {"integer": torch.randint(0, 3, (5, 4)), "float16": torch.randn(5, 4).half(),
             "feature dimension": torch.randn(5, 7)}[kind]
        return m, lambda: adapters.sharpness(m, [(x, torch.tensor([0, 1, 2, 0, 1]))], rho=0.1,
                                             geometry="adaptive", n_iters=1), ["batch 0", "first layer"]
    return make


def case_layout_vs_requires_grad(freeze_after: bool):
    def make():
        m, x = bert()
        name = "bert.encoder.layer.0.attention.self.query.weight"
        p = dict(m.named_parameters())[name]
        if freeze_after:
            lay = detect_layout(m)
            p.requires_grad_(False)
        else:
            p.requires_grad_(False)
            lay = detect_layout(m)
            p.requires_grad_(True)
        return m, lambda: adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, layout=lay,
                                             geometry="geodesic-inv"), ["requires_grad"]
    return make


def case_return_dict_false_labels():
    m, x = bert(return_dict=False)
    return m, lambda: adapters.sharpness(m, [{**x, "labels": torch.tensor([0, 1])}], rho=0.1, n_iters=1,
                                         geometry="adaptive"), ["return_dict"]


def case_inference_mode():
    m, x = bert()

    def call():
        with torch.inference_mode():
            return adapters.sharpness(m, batches(x), rho=0.1, n_iters=1, geometry="adaptive")
    return m, call, ["inference_mode"]


def case_hessian_inference_mode():
    from quotient_manifolds.adapters.hessian import riemannian_hessian
    m, x = bert()

    def call():
        with torch.inference_mode():
            op = riemannian_hessian(m, batches(x), geometry="adaptive")
            return op @ torch.ones(op.shape[1], dtype=torch.float64)
    return m, call, ["inference_mode"]


def case_float64_head():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Linear(8, 3).double()

        def forward(self, x):
            y, _ = self.attn(x, x, x, need_weights=False)
            return self.head(y.mean(1).double())

    torch.manual_seed(0)
    m = Mixed().eval()
    x = torch.randn(2, 5, 8)
    return m, lambda: len(detect_layout(m).verify(m, x).blocks) > 0, ("right", 1.0)


def case_oov_ids():
    m, _ = bert()
    ids = torch.tensor([[1, 2, 3, 70, 4, 5], [1, 2, 3, 4, 5, 6]])
    return m, lambda: adapters.sharpness(m, [({"input_ids": ids}, torch.tensor([0, 1]))], rho=0.1, n_iters=1,
                                         geometry="adaptive"), ["batch 0", "vocab"]


def case_empty_batch():
    m, _ = bert()
    ids = torch.zeros(0, 6, dtype=torch.long)
    return m, lambda: adapters.sharpness(m, [({"input_ids": ids}, torch.zeros(0, dtype=torch.long))], rho=0.1,
                                         n_iters=1, geometry="adaptive"), ["batch 0", "empty"]


def case_empty_targets_tensor_batch():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3)).double()
    return m, lambda: adapters.sharpness(m, [(torch.zeros(0, 4, dtype=torch.float64),
                                              torch.zeros(0, dtype=torch.long))], rho=0.1, n_iters=1,
                                         geometry="adaptive"), ["batch 0", "empty"]


def _results_dir(study="lora"):
    import shutil
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = tempfile.mkdtemp()
    dst = os.path.join(d, study)
    shutil.copytree(os.path.join(here, "experiments", "results", study), dst)
    return dst


def case_report_duplicate_line(study):
    def make():
        from quotient_manifolds.experiments.report import report_from_results
        d = _results_dir(study)
        path = os.path.join(d, "results.jsonl")
        lines = open(path).read().splitlines(True)
        n_ids = len({json.loads(ln)["model_id"] for ln in lines})
        open(path, "a").write(lines[2])

        def call():
            out = report_from_results(d, os.path.join(d, "again"), n_boot=5, log=lambda *_: None)
            n = out.get("n_models", n_ids) if isinstance(out, dict) else n_ids
            return float(n)
        return None, call, ("right", float(n_ids))
    return make


def _cli_fault(kind, study):
    """A study run whose writes fail (ENOSPC at fsync, or a read-only directory): the CLI must
    end with one line naming the path, and leave no temp file behind."""
    import contextlib
    import errno
    import io
    from quotient_manifolds.experiments import cli, runner

    d = tempfile.mkdtemp()
    out = os.path.join(d, "res")
    real_fsync = os.fsync

    def full_disk(fd):
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if kind == "full" or ".safetensors" in name:     # "full-checkpoint": only checkpoints fail
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    real_open = os.open

    def read_only(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and str(path).startswith(out):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *a, **k)

    def call():
        err = io.StringIO()
        import builtins
        real_builtin_open = builtins.open

        def ro_open(file, mode="r", *a, **k):
            if isinstance(file, str) and file.startswith(out) and any(c in mode for c in "wax+"):
                raise OSError(errno.EROFS, "Read-only file system", file)
            return real_builtin_open(file, mode, *a, **k)
        patches = ([(os, "fsync", full_disk)] if kind.startswith("full") else
                   [(os, "open", read_only), (builtins, "open", ro_open)])
        saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
        try:
            for mod, name, fn in patches:
                setattr(mod, name, fn)
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    argv = (["report", _results_dir("lora"), "--out", out] if study == "report" else
                            [study, "--quick", "--synthetic", "--no-progress", "--models", "1", "--out", out])
                    rc = cli.main(argv)
                except SystemExit as e:
                    rc = e.code
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)
        text = err.getvalue().strip()
        left = [f for _, _, fs in os.walk(d) for f in fs if ".tmp-" in f]
        if left:
            raise RuntimeError(f"left temp files {left}; stderr {text[-200:]}")
        if rc == 0:
            return "returned 0"
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if "Traceback" in text or len(lines) != 1:
            raise RuntimeError(f"not one line: {text[-300:]}")
        raise ValueError(text)
    return None, call, [out]


def case_cli_fault(kind, study):
    return lambda: _cli_fault(kind, study)


# --- the cases owned by other helpers this round (counted here too, on the whole surface)
def case_sam_second_step_nan():
    m, x = bert()
    opt = adapters.GeodesicSAM(m, torch.optim.SGD, lr=0.1, rho=0.05, geometry="geodesic-inv")

    def call():
        m(**x).logits.sum().backward()
        opt.first_step(zero_grad=True)
        m(**x).logits.sum().backward()
        m.bert.encoder.layer[0].attention.self.query.weight.grad[0, 0] = math.nan
        try:
            opt.second_step()
        finally:   # the .grad are the caller's own backward's; the weights must be w again
            m.zero_grad(set_to_none=True)
    return m, call, ["non-finite"]


def case_sam_lr_nan():
    m, x = bert()

    def call():
        opt = adapters.GeodesicSAM(m, torch.optim.SGD, lr=math.nan, rho=0.05, geometry="geodesic-inv")
        m(**x).logits.sum().backward()
        opt.first_step(zero_grad=True)
        m(**x).logits.sum().backward()
        opt.second_step()
    return m, call, ["lr"]


def case_verify_empty_batch():
    m, x = bert()
    return m, lambda: detect_layout(m).verify(m, {k: v[:0] for k, v in x.items()}), ["empty"]


def case_accept_empty_batch():
    m, x = bert()
    return m, lambda: adapters.accept_layout(m, detect_layout(m), {k: v[:0] for k, v in x.items()}), ["empty"]


def case_detect_string():
    return None, lambda: adapters.detect("x"), ["model"]


def case_accept_string_layout():
    m, x = bert()
    return m, lambda: adapters.accept_layout(m, "x", x), ["layout"]


def case_verify_output_fn_non_tensor():
    m, x = bert()
    return m, lambda: detect_layout(m).verify(m, x, output_fn=lambda o: o.logits.tolist()), ["output_fn"]


def _tiny_ball():
    from quotient_manifolds.adapters.components import ProductBall
    from quotient_manifolds.adapters.elementwise import ElementwiseComponent
    return ProductBall([ElementwiseComponent({"w": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)})])


def case_solver_call(call_of, words):
    """A call of the low-level solver on a tiny elementwise ball: ``call_of(ball)``."""
    return lambda: (None, lambda: call_of(_tiny_ball()), words)


def case_ball_params(kind):
    def make():
        m, _ = bert()
        params0 = {n: p.detach() for n, p in m.named_parameters()}
        lay = detect_layout(m)
        if kind == "list":
            return m, lambda: adapters.ball.build_ball(m, list(params0.values()), geometry="adaptive"), ["params0"]
        if kind == "int":
            return m, lambda: adapters.ball.build_ball(m, {n: p.long() for n, p in params0.items()},
                                                  geometry="adaptive"), ["params0"]
        if kind == "other model":
            other, _ = bert(heads=4)
            return m, lambda: adapters.ball.build_ball(m, params0, geometry="geodesic-inv",
                                                  layout=detect_layout(other)), ["layout"]
        return m, lambda: adapters.ball.build_ball(m, {"nope": params0[next(iter(params0))]}, geometry="adaptive"), \
            ["params0"]
    return make


def case_layout_call(kind):
    def make():
        m, _ = bert()
        lay = detect_layout(m)
        params0 = {n: p.detach() for n, p in m.named_parameters()}
        acts = lay.random_actions(scale=1.0, generator=torch.Generator().manual_seed(0))
        calls = {
            "random_actions, params missing a block": (lambda: lay.random_actions({}, scale=1.0), ["params"]),
            "random_actions, generator=3": (lambda: lay.random_actions(scale=1.0, generator=3), ["generator"]),
            "act, integer actions": (lambda: lay.act(params0, {k: v.long() for k, v in acts.items()}), ["actions"]),
            "act, NaN actions": (lambda: lay.act(params0, {k: v * math.nan for k, v in acts.items()}), ["actions"]),
            "act, unknown block": (lambda: lay.act(params0, {"nope": next(iter(acts.values()))}), ["unknown"]),
            "reparametrised, NaN actions": (lambda: lay.reparametrised(m, {k: v * math.nan for k, v in acts.items()}),
                                            ["actions"]),
            "reparametrised, singular actions": (lambda: lay.reparametrised(m, {k: v * 0 for k, v in acts.items()}),
                                                 ["singular"]),
        }
        call, words = calls[kind]
        return m, call, words
    return make


def case_targets(kind):
    def make():
        m, x = bert()
        y = {"class out of range": torch.tensor([0, 5]), "float targets": torch.tensor([0.0, 1.0]),
             "wrong batch size": torch.tensor([0, 1, 1]), "negative class": torch.tensor([-3, 1])}[kind]
        return m, lambda: adapters.sharpness(m, [(x, y)], rho=0.1, n_iters=1, geometry="adaptive"), ["targets"]
    return make


def case_next_token_loss(kind):
    def make():
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 5, 7, generator=g)
        if kind == "labels out of vocabulary":
            return None, lambda: adapters.next_token_loss(logits, torch.full((2, 5), 9)), ["class 9"]
        return None, lambda: adapters.next_token_loss(torch.randint(0, 3, (2, 5, 7)), torch.zeros(2, 5).long()), \
            ["logits"]
    return make


def case_core(kind):
    def make():
        geom, x = _gl_geometry()
        from quotient_manifolds.core.rescaling import RescalingGeometry
        resc = RescalingGeometry(3, "inv")
        xr = torch.tensor([[1.0, 2.0, -1.5], [0.5, -1.0, 2.0]], dtype=torch.float64)
        small = torch.full((9, 2), 0.01, dtype=torch.float64)
        calls = {
            "act, integer A": (lambda: geom.act(x, torch.eye(2, dtype=torch.long)), ["floating"]),
            "act, singular A": (lambda: geom.act(x, torch.zeros(2, 2, dtype=torch.float64)), ["singular"]),
            "act, NaN A": (lambda: geom.act(x, torch.full((2, 2), math.nan, dtype=torch.float64)), ["non-finite"]),
            "act, 3x3 A on h=2": (lambda: geom.act(x, torch.eye(3, dtype=torch.float64)), ["shape"]),
            "integrate_geodesic(t=nan)": (lambda: geom.integrate_geodesic(x, small, t=math.nan), ["t must"]),
            "integrate_geodesic(steps=-1)": (lambda: geom.integrate_geodesic(x, small, steps=-1), ["steps"]),
            "random_point(-1)": (lambda: geom.random_point(-1), ["batch"]),
            "random_point(generator=3)": (lambda: geom.random_point(generator=3), ["generator"]),
            "random_horizontal(integer x)": (lambda: geom.random_horizontal(x.long()), ["floating"]),
            "balance(integer x)": (lambda: geom.balance(x.long()), ["floating"]),
            "RescalingGeometry.act(a=0)": (lambda: resc.act(xr, torch.zeros(3, dtype=torch.float64)), ["non-zero"]),
            "RescalingGeometry.act(a=nan)": (lambda: resc.act(xr, torch.full((3,), math.nan)), ["finite"]),
        }
        call, words = calls[kind]
        return None, call, words
    return make


ROUND2: List[Tuple[str, str, Callable]] = [
    # (root cause, case, maker)
    ("checks at the top door only", "GLQuotientGeometry.project, integer tangent", case_core_integer("project")),
    ("checks at the top door only", "GLQuotientGeometry.inner, integer tangent", case_core_integer("inner")),
    ("checks at the top door only", "GLQuotientGeometry.egrad2rgrad, integer gradient", case_core_integer("egrad2rgrad")),
    ("checks at the top door only", "GLQuotientGeometry.retract, integer tangent", case_core_integer("retract")),
    ("checks at the top door only", "RescalingGeometry.project, integer tangent", case_rescaling_integer("project")),
    ("checks at the top door only", "RescalingGeometry.inner, integer tangent", case_rescaling_integer("inner")),
    ("checks at the top door only", "GLQuotientGeometry.inner, complex tangent", case_core_complex_tangent),
    ("checks at the top door only", "geoopt GLQuotient.random(dtype=complex64)", case_random_complex("geoopt")),
    ("checks at the top door only", "core random_point(dtype=complex64)", case_random_complex("core")),
    ("checks at the top door only", "geoopt GLQuotient.random(dtype=int64)", case_random_integer_dtype),
    ("checks at the top door only", "geoopt GLQuotient(np.int64 sizes)", case_numpy_int_sizes("geoopt")),
    ("checks at the top door only", "pymanopt GLQuotient(np.int64 sizes)", case_numpy_int_sizes("pymanopt")),
    ("checks at the top door only", "GLQuotientGeometry(np.int64 sizes)", case_numpy_int_sizes("core")),
    ("checks at the top door only", "RescalingGeometry(np.int64(3))", case_numpy_int_rescaling),
    ("checks at the top door only", "sharpness(n_iters=np.int64(3))", case_numpy_int_n_iters),
    ("checks at the top door only", "GLQuotientGeometry(5.0, 4, 2)", case_float_size),
    *[("checks at the top door only", f"core {k}", case_core(k)) for k in (
        "act, integer A", "act, singular A", "act, NaN A", "act, 3x3 A on h=2", "integrate_geodesic(t=nan)",
        "integrate_geodesic(steps=-1)", "random_point(-1)", "random_point(generator=3)",
        "random_horizontal(integer x)", "balance(integer x)", "RescalingGeometry.act(a=0)",
        "RescalingGeometry.act(a=nan)")],
    ("checks at the top door only", "auto_pgd(step_size_mult=0)", case_auto_pgd(step_size_mult=0.0)),
    ("checks at the top door only", "auto_pgd(step_size_mult=-1)", case_auto_pgd(step_size_mult=-1.0)),
    ("checks at the top door only", "auto_pgd(step_size_mult=nan)", case_auto_pgd(step_size_mult=math.nan)),
    ("checks at the top door only", "auto_pgd(alpha=nan)", case_auto_pgd(alpha=math.nan)),
    ("checks at the top door only", "auto_pgd(alpha=2)", case_auto_pgd(alpha=2.0)),
    ("checks at the top door only", "auto_pgd(decay=0)", case_auto_pgd(decay=0.0)),
    ("checks at the top door only", "auto_pgd(decay=1.5)", case_auto_pgd(decay=1.5)),
    ("checks at the top door only", "auto_pgd(min_update_ratio=nan)", case_auto_pgd(min_update_ratio=math.nan)),
    ("checks at the top door only", "auto_pgd(rho=nan)", case_auto_pgd(rho=math.nan)),
    ("checks at the top door only", "auto_pgd(rho='1')", case_auto_pgd(rho="1")),
    ("checks at the top door only", "auto_pgd(n_iters=np.int64(2))", lambda: (lambda m, b, c: (
        m, lambda: adapters.solver.auto_pgd(b, c, 0.1, n_iters=np.int64(2)).worst_loss,
        ("right", adapters.solver.auto_pgd(b, c, 0.1, n_iters=2).worst_loss)))(*_low_level())),
    ("checks at the top door only", "average_case(n_samples=0)", case_average_case(n_samples=0)),
    ("checks at the top door only", "average_case(n_samples=-1)", case_average_case(n_samples=-1)),
    ("checks at the top door only", "average_case(rho=inf)", case_average_case(rho=math.inf)),
    ("checks at the top door only", "build_ball(geodesic, no layout)", case_build_ball_no_layout),
    ("checks at the top door only", "Layout.random_actions(scale=0)", case_random_actions(0.0)),
    ("checks at the top door only", "Layout.random_actions(scale=nan)", case_random_actions(math.nan)),
    ("checks at the top door only", "Layout.random_actions(scale=-1)", case_random_actions(-1.0)),
    ("checks at the top door only", "auto_pgd, closure returns a float",
     case_solver_call(lambda b: adapters.solver.auto_pgd(b, lambda p: float(p[0].sum()), 0.1, n_iters=2), ["tensor"])),
    ("checks at the top door only", "auto_pgd, closure returns a vector",
     case_solver_call(lambda b: adapters.solver.auto_pgd(b, lambda p: p[0] ** 2, 0.1, n_iters=2), ["one number"])),
    ("checks at the top door only", "auto_pgd, closure=3",
     case_solver_call(lambda b: adapters.solver.auto_pgd(b, 3, 0.1, n_iters=2), ["closure"])),
    ("checks at the top door only", "auto_pgd, ball='ball'",
     case_solver_call(lambda b: adapters.solver.auto_pgd("ball", lambda p: p[0].sum(), 0.1, n_iters=2), ["ball"])),
    ("checks at the top door only", "auto_pgd, start=('x', 1.0)",
     case_solver_call(lambda b: adapters.solver.auto_pgd(b, lambda p: (p[0] ** 2).sum(), 0.1, n_iters=2,
                                                  start=("x", 1.0)), ["start"])),
    ("checks at the top door only", "average_case, generator=3",
     case_solver_call(lambda b: adapters.solver.average_case(b, lambda p: (p[0] ** 2).sum(), 0.1, n_samples=2,
                                                      generator=3), ["generator"])),
    ("checks at the top door only", "average_case, closure returns a vector",
     case_solver_call(lambda b: adapters.solver.average_case(b, lambda p: p[0] ** 2, 0.1, n_samples=2), ["one number"])),
    ("checks at the top door only", "average_case, closure returns a float",
     case_solver_call(lambda b: adapters.solver.average_case(b, lambda p: float((p[0] ** 2).sum()), 0.1, n_samples=2),
                      ["tensor"])),
    ("checks at the top door only", "build_ball, params0 a list", case_ball_params("list")),
    ("checks at the top door only", "build_ball, integer params0", case_ball_params("int")),
    ("checks at the top door only", "build_ball, params0 of unknown names", case_ball_params("names")),
    ("checks at the top door only", "build_ball, a 4-head layout on a 2-head BERT", case_ball_params("other model")),
    *[("checks at the top door only", f"Layout.{k}", case_layout_call(k)) for k in (
        "random_actions, params missing a block", "random_actions, generator=3", "act, integer actions",
        "act, NaN actions", "act, unknown block", "reparametrised, NaN actions", "reparametrised, singular actions")],
    *[("the default loss on the wrong axis", f"default loss, {k}", case_targets(k)) for k in (
        "class out of range", "float targets", "wrong batch size", "negative class")],
    ("the default loss on the wrong axis", "next_token_loss, labels out of vocabulary",
     case_next_token_loss("labels out of vocabulary")),
    ("the default loss on the wrong axis", "next_token_loss, integer logits", case_next_token_loss("int logits")),
    ("the default loss on the wrong axis", "token classifier, num_labels == seq_len", case_default_loss_token(6)),
    ("the default loss on the wrong axis", "token classifier, num_labels != seq_len", case_default_loss_token(3)),
    ("the default loss on the wrong axis", "causal LM with (ids, ids) pairs", case_default_loss_causal_lm),
    ("a larger ball returning 0", "adaptive, float32 tiny BERT, rho=1e5 vs 1e4",
     case_larger_ball(torch.float32, 1e5, 1e4)),
    ("a larger ball returning 0", "adaptive, float32 tiny BERT, rho=1e7 vs 1e4",
     case_larger_ball(torch.float32, 1e7, 1e4)),
    ("a larger ball returning 0", "adaptive, float64 tiny BERT, rho=1e6 vs 1e3",
     case_larger_ball(torch.float64, 1e6, 1e3)),
    *[("raw errors from inside the model (round 4)", f"{k} inputs to a float32 MLP", case_mlp_inputs(k))
      for k in ("integer", "float16", "feature dimension")],
    ("messages that point the wrong way", "layout built before freezing a weight", case_layout_vs_requires_grad(True)),
    ("messages that point the wrong way", "layout built while a weight was frozen", case_layout_vs_requires_grad(False)),
    ("messages that point the wrong way", "return_dict=False with labels", case_return_dict_false_labels),
    ("messages that point the wrong way", "sharpness inside torch.inference_mode()", case_inference_mode),
    ("messages that point the wrong way", "riemannian_hessian inside torch.inference_mode()",
     case_hessian_inference_mode),
    ("messages that point the wrong way", "float64 head over a float32 body: verify", case_float64_head),
    ("messages that point the wrong way", "out-of-vocabulary token id", case_oov_ids),
    ("messages that point the wrong way", "empty batch (0 rows of ids)", case_empty_batch),
    ("messages that point the wrong way", "empty batch (tensor inputs)", case_empty_targets_tensor_batch),
    ("records counted twice", "report: duplicated line (diagonal)", case_report_duplicate_line("diagonal")),
    ("records counted twice", "report: duplicated line (lora)", case_report_duplicate_line("lora")),
    ("faults as tracebacks", "CLI text study on a full disk", case_cli_fault("full", "text")),
    ("faults as tracebacks", "CLI text study, read-only results directory", case_cli_fault("read-only", "text")),
    ("faults as tracebacks", "CLI text study, disk full at the checkpoint", case_cli_fault("full-checkpoint", "text")),
    ("faults as tracebacks", "CLI report on a full disk", case_cli_fault("full", "report")),
    ("faults as tracebacks", "CLI report, read-only --out", case_cli_fault("read-only", "report")),
    ("model corrupted (SAM helper)", "GeodesicSAM.second_step with a NaN gradient", case_sam_second_step_nan),
    ("model corrupted (SAM helper)", "GeodesicSAM(lr=nan)", case_sam_lr_nan),
    ("verification that proves nothing (round 3)", "verify on an empty batch", case_verify_empty_batch),
    ("verification that proves nothing (round 3)", "accept_layout on an empty batch", case_accept_empty_batch),
    ("checks at the top door only (round 3)", "detect('x')", case_detect_string),
    ("checks at the top door only (round 3)", "accept_layout(m, 'x')", case_accept_string_layout),
    ("checks at the top door only (round 3)", "verify(output_fn=non-tensor)", case_verify_output_fn_non_tensor),
]


def _state(model):
    """What a call must leave as it found: every parameter and buffer, requires_grad, .grad and
    every submodule's train/eval flag."""
    return (snapshot(model), {n: p.requires_grad for n, p in model.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            [mod.training for mod in model.modules()])


def _equal(a, b) -> bool:
    """Equal, NaN included (a NaN gradient left as it was is unchanged)."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def _same_state(model, before) -> bool:
    snap, flags, grads, modes = before
    now = _state(model)
    return (unchanged(model, snap) and now[1] == flags and [mod.training for mod in model.modules()] == modes
            and all((grads[n] is None) == (g is None) and (g is None or _equal(g, grads[n]))
                    for n, g in now[2].items()))


def classify(make) -> Tuple[str, str]:
    try:
        model, call, expect = make()
    except Exception as err:  # noqa: BLE001 - the set-up itself refused (e.g. an unsupported config)
        return ("clear" if isinstance(err, CLEAR_TYPES) else "unhelpful"), f"set-up: {type(err).__name__}: {err}"
    before = _state(model) if model is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = call()
            err = None
        except Exception as e:  # noqa: BLE001
            err = e
    if before is not None and not _same_state(model, before):
        return "corrupts", f"{type(err).__name__ if err else 'returned'}; the model changed"
    if isinstance(expect, tuple) and expect[0] == "right":   # a right answer exists
        if err is None and math.isclose(float(result), float(expect[1]), rel_tol=1e-12):
            return "right", f"{float(result)!r}"
        return ("silent wrong" if err is None else "unhelpful"), \
            repr(err or f"{result!r}, expected {expect[1]!r}")
    words = expect[1] if isinstance(expect, tuple) else expect
    if err is None:
        if isinstance(expect, tuple) and expect[0] == "warn" and len(expect) > 2 and result == expect[2]:
            return "right", "not less than the smaller ball's"
        if isinstance(expect, tuple) and expect[0] == "warn":
            said = [str(w.message) for w in caught]
            if any(any(x.lower() in s.lower() for x in words) for s in said):
                return "clear", f"warned: {said[0]}"
        return "silent wrong", f"returned {getattr(result, 'value', result)!r}"
    said = f"{type(err).__name__}: {err}"
    if isinstance(err, CLEAR_TYPES) and any(w.lower() in str(err).lower() for w in words):
        return "clear", said
    return "unhelpful", said


def main() -> None:
    only = sys.argv[1:]
    rows: List[Dict[str, str]] = []
    cases = [(f"round 1 ({was})", name, make) for was, name, make in CASES] + ROUND2
    for cause, name, make in cases:
        if only and not any(o in cause or o in name for o in only):
            continue
        now, said = classify(make)
        line = (said.splitlines() or [""])[0]
        rows.append({"cause": cause, "case": name, "now": now, "message": line[:160]})
        print(f"{now:13s} | {cause[:34]:34s} | {name} | {line[:140]}", flush=True)
    by_cause: Dict[str, Dict[str, int]] = {}
    for r in rows:
        c = by_cause.setdefault(r["cause"], {})
        c[r["now"]] = c.get(r["now"], 0) + 1
    print()
    for cause, c in by_cause.items():
        print(f"{cause:55s} {json.dumps(c)}")
    totals: Dict[str, int] = {}
    for r in rows:
        totals[r["now"]] = totals.get(r["now"], 0) + 1
    print("\n" + json.dumps(totals))


if __name__ == "__main__":
    main()
