"""Correlation studies of adaptive vs geodesic sharpness ("Hide & Seek", arXiv 2505.05409).

Run ``python -m experiments --help``. Studies: ``diagonal`` (diagonal linear nets, closed-form
geodesics), ``text`` (MiniLM fine-tunes on MR polarity), ``vision`` (small ViTs on Fashion-MNIST),
``invariance`` (sharpness under GL(h) reparametrisation), ``retraction`` (first/second-order/exact
geodesics); and two training studies: ``sam`` (SAM, ASAM and geodesic SAM) and ``lora`` (LoRA
optimizers, the GL(r)-invariant ones among them). Support modules: :mod:`experiments.stats` (Kendall τ, bootstrap CI, gap),
:mod:`experiments.runner` (crash-safe JSONL results, checkpoints, worker processes),
:mod:`experiments.data` (data through pip/apt), :mod:`experiments.vit` (the small ViT).

This package deliberately imports nothing heavy at import time (``python -m experiments`` sets the
BLAS thread count before numpy is loaded).
"""

__all__ = ["STUDIES"]

STUDIES = ("diagonal", "text", "vision", "invariance", "retraction", "sam", "lora", "matched")
