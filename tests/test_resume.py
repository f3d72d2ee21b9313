"""Save and resume: training stopped at a checkpoint and resumed from it (a plain torch.save of the
model's and the optimizer's state dicts, a copy.deepcopy of the model, and the Trainer's own
checkpoint) is bit-identical to uninterrupted training, for GeodesicSAM, InvariantRiemannianSGD over
LoRA quotient points and quotient_manifolds.geoopt.RiemannianSGD over ManifoldParameters of the GL
quotient. Only the public behaviour is used (state_dict / load_state_dict, step)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from quotient_manifolds import adapters
from quotient_manifolds.geoopt import GLQuotient, RiemannianSGD

transformers = pytest.importorskip("transformers")

STEPS, STOP = 4, 2


def _through_disk(obj):
    """``obj`` after torch.save and torch.load (a checkpoint file, in memory)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resumed(build, step, steps=STEPS, stop=STOP, deepcopy=False, load_optimizer=True):
    """(uninterrupted weights, resumed weights): ``build()`` -> (module, optimizer); ``step(module,
    optimizer, k)`` the k-th update. Resumed: a fresh build, the state dicts loaded from a saved
    checkpoint at ``stop`` (or the model deep-copied and a fresh optimizer loaded)."""
    model, opt = build()
    for k in range(steps):
        step(model, opt, k)
    straight = {n: t.detach().clone() for n, t in model.state_dict().items()}

    model, opt = build()
    for k in range(stop):
        step(model, opt, k)
    checkpoint = _through_disk({"model": model.state_dict(), "optimizer": opt.state_dict()})
    if deepcopy:
        copied = copy.deepcopy(model)
        del model, opt
        model, opt = build(copied)
    else:
        del model, opt
        model, opt = build()
        model.load_state_dict(checkpoint["model"])
    if load_optimizer:   # (False: the control, a resumed run that lost the optimizer's state)
        opt.load_state_dict(checkpoint["optimizer"])
    for k in range(stop, steps):
        step(model, opt, k)
    return straight, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _assert_bit_identical(straight, resumed):
    assert straight.keys() == resumed.keys()
    different = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    assert not different, different[:5]


def _assert_the_optimizer_state_matters(build, step, **kw):
    """The control: resuming without the optimizer's state (momentum, Adam moments) gives other
    weights, so the bit-identity above comes from the state dict."""
    straight, lost = _resumed(build, step, load_optimizer=False, **kw)
    assert any(not torch.equal(straight[n], lost[n]) for n in straight)


# ------------------------------------------------------------------------------------ GeodesicSAM
def _bert(dropout=0.0):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                  initializer_range=0.3)
    return transformers.BertForSequenceClassification(cfg).double()


def _batch(k):
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(1, 40, (4, 6), generator=g)
    return ids, (ids[:, 0] > 20).long()


@pytest.mark.parametrize("deepcopy", [False, True])
def test_geodesic_sam_resumes_bit_identically(deepcopy):
    def build(model=None):
        model = _bert() if model is None else model
        return model, adapters.GeodesicSAM(model, torch.optim.AdamW, rho=0.05, geometry="geodesic-mix", lr=1e-2)

    def step(model, opt, k):
        ids, labels = _batch(k)
        loss = lambda: nn.functional.cross_entropy(model(ids).logits, labels)  # noqa: E731
        loss().backward()
        opt.first_step(zero_grad=True)
        loss().backward()
        opt.second_step(zero_grad=True)

    _assert_bit_identical(*_resumed(build, step, deepcopy=deepcopy))
    _assert_the_optimizer_state_matters(build, step, deepcopy=deepcopy)


def _sam_build(model=None):
    model = _bert() if model is None else model
    return model, adapters.GeodesicSAM(model, torch.optim.AdamW, rho=0.05, geometry="geodesic-mix", lr=1e-2)


def _sam_step(model, opt, k):
    ids, labels = _batch(k)
    opt.step(lambda: nn.functional.cross_entropy(model(ids).logits, labels).backward())


def test_geodesic_sam_state_dict_is_the_base_optimizers_and_is_needed_to_resume():
    model, opt = _sam_build()
    _sam_step(model, opt, 0)
    assert opt.state_dict()["state"].keys() == opt.base_optimizer.state_dict()["state"].keys() != set()
    _assert_bit_identical(*_resumed(_sam_build, _sam_step))        # step(closure) too
    _assert_the_optimizer_state_matters(_sam_build, _sam_step)


# ---------------------------------------------------------------- InvariantRiemannianSGD over LoRA
@pytest.mark.parametrize("deepcopy", [False, True])
def test_invariant_riemannian_sgd_over_lora_points_resumes_bit_identically(deepcopy):
    peft = pytest.importorskip("peft")

    def fresh_lora():
        torch.manual_seed(0)
        base = _bert()
        model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["query", "value"],
                                                          task_type="SEQ_CLS"))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        return model

    def build(model=None):
        if model is None:
            model = fresh_lora()
            groups = adapters.lora_quotient_parameters(model, metric="mix")
        else:   # a deep copy holds its own points already
            from quotient_manifolds.adapters.lora_training import lora_quotient_points
            points = list(lora_quotient_points(model).values())
            ids = {id(p.x) for p in points}
            groups = [{"params": [p.x for p in points], "weight_decay": 0.0},
                      {"params": [p for p in model.parameters() if p.requires_grad and id(p) not in ids]}]
        return model, adapters.InvariantRiemannianSGD(groups, lr=0.05, momentum=0.9)

    def step(model, opt, k):
        ids, labels = _batch(k)
        opt.zero_grad()
        nn.functional.cross_entropy(model(input_ids=ids).logits, labels).backward()
        opt.step()

    _assert_bit_identical(*_resumed(build, step, deepcopy=deepcopy))
    _assert_the_optimizer_state_matters(build, step, deepcopy=deepcopy)


# ----------------------------------------------- quotient_manifolds.geoopt.RiemannianSGD on GL(h)
class _Factors(nn.Module):
    """One point x = [G; H] of GLQuotient(n, m, h) (a batch of 3 quotients) as a ManifoldParameter."""

    def __init__(self):
        super().__init__()
        import geoopt

        manifold = GLQuotient(6, 5, 2, metric="mix")
        g = torch.Generator().manual_seed(0)
        self.x = geoopt.ManifoldParameter(torch.randn(3, 11, 2, generator=g, dtype=torch.float64), manifold=manifold)
        self.target = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)

    def loss(self):
        G, H = self.x[:, :6], self.x[:, 6:]
        return (G @ H.transpose(-1, -2) - self.target).square().sum()


@pytest.mark.parametrize("deepcopy", [False, True])
def test_riemannian_sgd_over_manifold_parameters_resumes_bit_identically(deepcopy):
    def build(model=None):
        model = _Factors() if model is None else model
        return model, RiemannianSGD(model.parameters(), lr=0.01, momentum=0.9, dampening=0.1)

    def step(model, opt, k):
        opt.zero_grad()
        model.loss().backward()
        opt.step()

    _assert_bit_identical(*_resumed(build, step, steps=6, stop=3, deepcopy=deepcopy))
    _assert_the_optimizer_state_matters(build, step, steps=6, stop=3, deepcopy=deepcopy)


# ----------------------------------------------------------------- the Trainer's own checkpoint
def test_geodesic_sam_trainer_resumes_from_its_checkpoint_bit_identically(tmp_path):
    from test_integrations import _sam_trainer, tiny_model

    def train(out, **kw):
        model = tiny_model(dropout=0.1)                # dropout: the RNG state is in the checkpoint
        trainer = _sam_trainer(out, model, "geodesic-mix", max_steps=4, save_strategy="steps", save_steps=2)
        trainer.train(**kw)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    straight = train(tmp_path / "a")
    resumed = train(tmp_path / "b", resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    _assert_bit_identical(straight, resumed)
