"""Sharpness in the Hugging Face Trainer (adapters.integrations.SharpnessCallback) and geodesic SAM
as a Trainer (GeodesicSAMTrainer): the logged values are those of a direct adapters.sharpness call,
the training run is unchanged by the callback, the reporters receive the scalars."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from quotient_manifolds import adapters  # noqa: E402
from quotient_manifolds.adapters.integrations import GeodesicSAMTrainer, SharpnessCallback  # noqa: E402
from quotient_manifolds.adapters.monitor import SharpnessMonitor  # noqa: E402
from quotient_manifolds.errors import InvalidArgument, InvalidArgumentType, UsageError

VOCAB, LENGTH = 40, 6


def tiny_model(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                  initializer_range=0.3)
    return transformers.BertForSequenceClassification(cfg).double()


def examples(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    labels = (ids[:, 0] > VOCAB // 2).long()   # learnable: the first token decides
    return [{"input_ids": i, "attention_mask": torch.ones(LENGTH, dtype=torch.long), "labels": y}
            for i, y in zip(ids, labels)]


def held_batches():
    rows = examples(8, seed=1)
    return [{k: torch.stack([r[k] for r in rows[i:i + 4]]) for k in rows[0]} for i in (0, 4)]


def training_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2,
                max_steps=4, logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True, seed=3, dataloader_num_workers=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def test_logged_sharpness_equals_a_direct_call_and_rho_is_calibrated_once(tmp_path):
    model = tiny_model()
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=examples(16, 0))
    callback = SharpnessCallback(trainer, held_batches(), geometries=["geodesic-inv", "adaptive"],
                                 every_n_steps=2, target_loss_rise=0.05, n_iters=3)
    trainer.add_callback(callback)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "sharpness/geodesic-inv" in h]
    assert [h["step"] for h in logged] == [2, 4]
    assert set(callback.monitor.calibrations) == {"geodesic-inv", "adaptive"}
    for geometry in ("geodesic-inv", "adaptive"):
        rhos = [h[f"sharpness/{geometry}/rho"] for h in logged]
        assert rhos[0] == rhos[1] == callback.monitor.calibrations[geometry].rho
        # the last measurement is at the final weights: a direct call on them gives the same value
        direct = adapters.sharpness(model, held_batches(), geometry=geometry, rho=rhos[-1], n_iters=3)
        assert abs(logged[-1][f"sharpness/{geometry}"] - direct.value) <= 1e-10
        assert abs(logged[-1][f"sharpness/{geometry}/initial_loss"] - sum(direct.init_losses) / 2) <= 1e-10
        assert logged[-1][f"sharpness/{geometry}/seconds"] > 0
    assert model.training is True     # the Trainer's mode, as the callback found it


def _trained_parameters(tmp_path, with_callback: bool):
    model = tiny_model(dropout=0.2)     # dropout draws from torch's generator at every step
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path, max_steps=5),
                                   train_dataset=examples(16, 0))
    if with_callback:
        trainer.add_callback(SharpnessCallback(trainer, held_batches(), geometries=["geodesic-inv"],
                                               every_n_steps=1, at_train_begin=True, rho=0.05, n_iters=2))
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_training_is_bit_identical_with_and_without_the_callback(tmp_path):
    without = _trained_parameters(tmp_path / "a", with_callback=False)
    with_cb = _trained_parameters(tmp_path / "b", with_callback=True)
    assert all(torch.equal(without[n], with_cb[n]) for n in without)


def test_monitor_restores_mode_gradients_and_random_generators():
    import random

    import numpy as np

    model = tiny_model()
    model.train()
    model.bert.embeddings.eval()                     # a submodule kept in eval mode stays so
    model(**held_batches()[0]).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    monitor = SharpnessMonitor(held_batches(), geometries=["geodesic-inv"], rho=0.1, n_iters=2)
    metrics = monitor.measure(model, step=7)
    assert set(metrics) == {"sharpness/geodesic-inv", "sharpness/geodesic-inv/rho",
                            "sharpness/geodesic-inv/initial_loss", "sharpness/geodesic-inv/seconds"}
    assert monitor.history == [(7, metrics)]
    assert model.training and not model.bert.embeddings.training
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert (np.random.get_state()[1] == states[2]).all()


def test_preserved_training_state_undoes_what_a_measurement_could_change():
    import random

    import numpy as np

    from quotient_manifolds.adapters.monitor import preserved_training_state

    model = tiny_model()
    model.train()
    model(**held_batches()[0]).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    with pytest.raises(KeyboardInterrupt):
        with preserved_training_state(model):
            assert not model.training
            torch.rand(5), random.random(), np.random.rand(4)
            model.zero_grad(set_to_none=True)
            model.train()
            raise KeyboardInterrupt
    assert model.training and all(p.grad is grads[n] for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert (np.random.get_state()[1] == states[2][1]).all()


def test_the_tensorboard_event_file_holds_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = tiny_model()
    args = training_args(tmp_path, report_to=["tensorboard"], max_steps=2)   # writes under output_dir
    trainer = transformers.Trainer(model=model, args=args, train_dataset=examples(8, 0))
    trainer.add_callback(SharpnessCallback(trainer, held_batches()[:1], geometries=["geodesic-inv"],
                                           every_n_steps=1, rho=0.1, n_iters=2))
    trainer.train()
    files = glob.glob(os.path.join(args.output_dir, "**", "events.out.tfevents.*"), recursive=True)
    assert files
    events = EventAccumulator(os.path.dirname(files[0]))
    events.Reload()
    logged = {h["step"]: h["sharpness/geodesic-inv"] for h in trainer.state.log_history
              if "sharpness/geodesic-inv" in h}
    scalars = {e.step: e.value for e in events.Scalars("train/sharpness/geodesic-inv")}
    assert sorted(scalars) == [1, 2]
    assert all(abs(scalars[s] - logged[s]) <= 1e-6 * max(1.0, abs(logged[s])) for s in scalars)  # float32 file
    assert "train/sharpness/geodesic-inv/rho" in events.Tags()["scalars"]


def test_errors_say_what_to_do(tmp_path):
    trainer = transformers.Trainer(model=tiny_model(), args=training_args(tmp_path), train_dataset=examples(8, 0))
    with pytest.raises(InvalidArgumentType, match="needs the transformers.Trainer"):
        SharpnessCallback(held_batches(), held_batches(), every_n_steps=1, rho=0.1)
    with pytest.raises(InvalidArgument, match="never measure"):
        SharpnessCallback(trainer, held_batches(), rho=0.1)
    with pytest.raises(InvalidArgumentType, match="exactly one of rho"):
        SharpnessCallback(trainer, held_batches(), every_n_steps=1)
    with pytest.raises(InvalidArgumentType, match="exactly one of rho"):
        SharpnessCallback(trainer, held_batches(), every_n_steps=1, rho=0.1, target_loss_rise=0.1)
    with pytest.raises(InvalidArgument, match="geometry"):
        SharpnessCallback(trainer, held_batches(), every_n_steps=1, rho=0.1, geometries=["geodesic"])
    with pytest.raises(InvalidArgumentType, match="unexpected keyword"):
        SharpnessCallback(trainer, held_batches(), every_n_steps=1, rho=0.1, n_iter=3)
    with pytest.raises(InvalidArgumentType, match="set by the monitor"):
        SharpnessCallback(trainer, held_batches(), every_n_steps=1, rho=0.1, geometry="adaptive")
    with pytest.raises(InvalidArgument, match="one radius per geometry"):
        SharpnessCallback(trainer, held_batches(), every_n_steps=1, rho={"adaptive": 0.1})
    with pytest.raises(InvalidArgument, match="empty"):
        SharpnessCallback(trainer, [], every_n_steps=1, rho=0.1)
    other = transformers.Trainer(model=tiny_model(), args=training_args(tmp_path), train_dataset=examples(8, 0))
    other.add_callback(SharpnessCallback(trainer, held_batches(), every_n_steps=1, rho=0.1))
    with pytest.raises(UsageError, match="another Trainer"):
        other.train()


def _sam_trainer(tmp_path, model, geometry, **kw):
    args = training_args(tmp_path, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", **kw)
    return GeodesicSAMTrainer(model=model, args=args, train_dataset=examples(32, 0), sam_rho=0.1,
                              sam_geometry=geometry)


def test_geodesic_sam_trainer_lowers_the_loss_in_one_epoch(tmp_path):
    model = tiny_model(dropout=0.0)
    held = held_batches()
    with torch.no_grad():
        before = sum(float(model(**b).loss) for b in held)
    trainer = _sam_trainer(tmp_path, model, "geodesic-mix", max_steps=-1, num_train_epochs=1)
    trainer.train()
    model.eval()
    with torch.no_grad():
        after = sum(float(model(**b).loss) for b in held)
    assert trainer.state.global_step == 8 and isinstance(trainer.optimizer.optimizer, adapters.GeodesicSAM)
    assert after < before
    assert float(trainer.perturbed_loss) > 0


def test_geodesic_sam_trainer_perturbs_the_same_function_from_every_representative(tmp_path):
    from conftest import reparametrised_copy

    model = tiny_model(dropout=0.0).eval()
    twin = reparametrised_copy(model, scale=1.0, cond=10.0, seed=1)
    batch = held_batches()[0]
    with torch.no_grad():                            # the same function, another representative
        assert torch.allclose(model(**batch).logits, twin(**batch).logits, atol=1e-10)
    losses = {}
    for geometry in ("geodesic-mix", "sam"):
        for name, m in (("model", model), ("twin", twin)):
            trainer = _sam_trainer(tmp_path / f"{geometry}-{name}", copy.deepcopy(m), geometry, max_steps=1)
            trainer.train()
            losses[geometry, name] = float(trainer.perturbed_loss)
    # L(w_adv) of the first step: invariant for geodesic SAM, not for plain SAM
    assert abs(losses["geodesic-mix", "model"] - losses["geodesic-mix", "twin"]) < 1e-10
    assert abs(losses["sam", "model"] - losses["sam", "twin"]) > 1e-4


def test_geodesic_sam_trainer_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(InvalidArgument, match="gradient_accumulation_steps=1"):
        _sam_trainer(tmp_path, tiny_model(), "geodesic-mix", gradient_accumulation_steps=2)
    with pytest.raises(InvalidArgument, match="sam_geometry"):
        _sam_trainer(tmp_path, tiny_model(), "geodesic")
    with pytest.raises(InvalidArgument, match="sam_rho"):
        GeodesicSAMTrainer(model=tiny_model(), args=training_args(tmp_path), sam_rho=-1.0)
