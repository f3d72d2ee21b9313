"""Pinned configuration hashes: a resumable run finds its own results and checkpoints by these
hashes, so a refactoring must not move them.

The study configurations are hashed with ``runner.config_hash`` (results.jsonl, config.json) and
every trained model's checkpoint is named by its training hash: the literals below are the values
of the default configuration of every study and protocol (and of model 0's training run). A
deliberate change of a default is a new configuration: update the literal in the same commit and
say so in the changelog."""

from __future__ import annotations

import json
import os

import pytest

from quotient_manifolds.experiments import diagonal, lora, matched, sam_study, text, vision
from quotient_manifolds.experiments.runner import config_hash

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                       "results")

#: (study, module, defaults) -> (config hash, model 0's training hash or None, pretraining hash)
PINNED = {
    "diagonal": ("diagonal", lambda: diagonal.defaults(False), "a1179ea6d1e3cd02", "f0ca0cb64ed7e153"),
    "text-small": ("text", lambda: text.defaults(False, False, "small"), "7fe386b88e2c546a",
                   "6513046ee6ddcecc"),
    "text-paper-seeds": ("text", lambda: text.defaults(False, False, "paper", "seeds"),
                         "934df47b0afbbd2c", "c0961b7562e2c221"),
    "text-paper-random": ("text", lambda: text.defaults(False, False, "paper", "random"),
                          "5bac45eb59230e15", "cfd85272dbc62226"),
    "vision-finetune": ("vision", lambda: vision.defaults(False, False, "finetune"),
                        "b43a842a5a827283", "e3417a0e28ff185b"),
    "vision-scratch": ("vision", lambda: vision.defaults(False, False, "scratch"),
                       "e73bf32f0fbbdea7", "720d1064d3ed8189"),
    "lora": ("lora", lambda: lora.defaults(False), "d39e03827c25b777", None),
    "sam": ("sam", lambda: sam_study.defaults(False), "ca31f0dcc8a42c36", None),
    "matched": ("matched", lambda: matched.defaults(False, False), "3554a7deb20f46e8", None),
}
TRAINED = {"diagonal": diagonal, "text": text, "vision": vision}


@pytest.mark.parametrize("key", sorted(PINNED))
def test_default_configuration_hashes_are_pinned(key):
    study, defaults, want_config, want_train = PINNED[key]
    config = defaults()
    assert config_hash({"study": study, **config}) == want_config
    if want_train is not None:
        mod = TRAINED[study]
        assert mod.train_hash(config, mod.hparams(config, 0)) == want_train


def test_the_shared_pretrained_vit_keeps_its_hash():
    assert vision.pretrain_hash(vision.defaults(False, False, "finetune")) == "9cb5b721fa4ddf44"


@pytest.mark.parametrize("name", sorted(d for d in os.listdir(RESULTS)
                                        if os.path.exists(os.path.join(RESULTS, d, "config.json"))))
def test_committed_runs_hash_to_their_recorded_hash(name):
    """Every committed results folder resumes: its configuration still hashes to the hash its
    records carry."""
    with open(os.path.join(RESULTS, name, "config.json")) as fh:
        saved = json.load(fh)
    assert config_hash({"study": saved["study"], **saved["config"]}) == saved["config_hash"]
