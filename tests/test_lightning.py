"""Lightning: the sharpness callback (values of a direct adapters.sharpness call, written by the
CSV logger, the run unchanged) and geodesic SAM with manual optimization (one epoch lowers the loss)."""

from __future__ import annotations

import csv
import glob
import os

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from quotient_manifolds import adapters  # noqa: E402
from quotient_manifolds.adapters.lightning import LightningSharpnessCallback  # noqa: E402


class Classifier(pl.LightningModule):
    """A tiny BERT classifier: forward(ids) -> logits; SGD, or geodesic SAM (manual optimization)."""

    def __init__(self, sam: bool = False, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                      initializer_range=0.3)
        self.net = transformers.BertForSequenceClassification(cfg).double()
        self.sam = sam
        self.automatic_optimization = not sam

    def forward(self, ids):
        return self.net(input_ids=ids).logits

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        if not self.sam:
            return nn.functional.cross_entropy(self(ids), labels)

        def closure():                 # evaluated at w, then at w_adv, by GeodesicSAM.step
            loss = nn.functional.cross_entropy(self(ids), labels)
            self.manual_backward(loss)
            return loss

        return self.optimizers().step(closure=closure)   # one update: global_step advances

    def configure_optimizers(self):
        if self.sam:
            return adapters.GeodesicSAM(self, torch.optim.SGD, rho=0.1, geometry="geodesic-mix", lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (n, 6), generator=g)
    return list(zip(ids, (ids[:, 0] > 20).long()))


def held():
    rows = data(8, 1)
    return [(torch.stack([r[0] for r in rows[i:i + 4]]), torch.stack([r[1] for r in rows[i:i + 4]])) for i in (0, 4)]


def fit(module, tmp_path, callbacks=(), steps=4):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=pl.loggers.CSVLogger(str(tmp_path)),
                         callbacks=list(callbacks), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, torch.utils.data.DataLoader(data(16, 0), batch_size=4, shuffle=True))
    return trainer


def test_the_callback_logs_a_direct_calls_value_and_leaves_the_run_unchanged(tmp_path):
    callback = LightningSharpnessCallback(held(), geometries=["geodesic-inv"], every_n_steps=2, rho=0.1,
                                          n_iters=3, loss_fn=nn.functional.cross_entropy)
    module = Classifier(dropout=0.2)
    fit(module, tmp_path / "a", [callback])
    assert [s for s, _ in callback.monitor.history] == [2, 4]
    direct = adapters.sharpness(module, held(), geometry="geodesic-inv", rho=0.1, n_iters=3,
                                loss_fn=nn.functional.cross_entropy)
    assert abs(callback.monitor.history[-1][1]["sharpness/geodesic-inv"] - direct.value) <= 1e-10
    with open(glob.glob(os.path.join(str(tmp_path / "a"), "**", "metrics.csv"), recursive=True)[0]) as fh:
        rows = list(csv.DictReader(fh))
    logged = {int(r["step"]): float(r["sharpness/geodesic-inv"]) for r in rows if r.get("sharpness/geodesic-inv")}
    assert sorted(logged) == [2, 4] and abs(logged[4] - direct.value) <= 1e-10
    plain = Classifier(dropout=0.2)
    fit(plain, tmp_path / "b")
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), plain.parameters()))


def test_geodesic_sam_with_manual_optimization_lowers_the_loss_in_one_epoch(tmp_path):
    module = Classifier(sam=True)
    ids, labels = map(torch.cat, zip(*held()))
    with torch.no_grad():
        before = float(nn.functional.cross_entropy(module(ids), labels))
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data(32, 0), batch_size=4))
    module.eval()
    with torch.no_grad():
        after = float(nn.functional.cross_entropy(module(ids), labels))
    assert trainer.global_step == 8 and after < before
