"""Correlation studies of adaptive vs geodesic sharpness ("Hide & Seek", arXiv 2505.05409).

Run ``quotient-manifolds --help``. Studies: ``diagonal`` (diagonal linear nets, closed-form
geodesics), ``text`` (MiniLM fine-tunes on MR polarity), ``vision`` (small ViTs on Fashion-MNIST),
``invariance`` (sharpness under GL(h) reparametrisation), ``retraction`` (first/second-order/exact
geodesics); and two training studies: ``sam`` (SAM, ASAM and geodesic SAM) and ``lora`` (LoRA
optimizers, the GL(r)-invariant ones among them). Support modules:
:mod:`quotient_manifolds.experiments.stats` (Kendall τ, bootstrap CI, gap),
:mod:`quotient_manifolds.experiments.runner` (crash-safe JSONL results, checkpoints, worker processes),
:mod:`quotient_manifolds.experiments.provenance` (commit, versions and weights hash of every record;
bit-reproducible training),
:mod:`quotient_manifolds.experiments.training` (the training loop of every study),
:mod:`quotient_manifolds.experiments.reporting` (what the studies' summaries share),
:mod:`quotient_manifolds.experiments.data` (data through pip/apt),
:mod:`quotient_manifolds.experiments.text_model` (the MiniLM model, its data and training),
:mod:`quotient_manifolds.experiments.vit` (the small ViT).

This package imports nothing heavy at import time; each study loads what it needs.
"""

__all__ = ["STUDIES"]

from .studies import STUDIES  # noqa: E402 (after the docstring and __all__)
