r"""The studies, looked up by name: one :class:`Study` each, in :data:`STUDY` (as
:data:`quotient_manifolds.adapters.families.FAMILIES` holds the attention families).

The command line builds a subcommand per study from it and ``quotient-manifolds report DIR``
finds how to recompute a study's summary from it. A study's module provides ``add_arguments(p)``
(its own options), ``run(args, log) -> int`` (the subcommand) and, where ``report`` is
``"own"``, ``report(out_dir, config, config_hash, records, ...)``. Importing this module imports
no study: :meth:`Study.load` imports one when it is needed.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, Optional

__all__ = ["Study", "STUDY", "STUDIES", "study"]


@dataclass(frozen=True)
class Study:
    """A study of the command line (``quotient-manifolds NAME``).

    ``module``: its module in :mod:`quotient_manifolds.experiments`; ``help``: its line in
    ``quotient-manifolds --help``; ``options``: which of the common options it has (keyword
    arguments of :func:`~quotient_manifolds.experiments.options.common_arguments`); ``report``:
    how ``report DIR`` recomputes its summary from its results.jsonl, ``"population"`` (text and
    vision: :func:`~quotient_manifolds.experiments.population_summary.population_report`), ``"diagonal"``
    (:func:`~quotient_manifolds.experiments.diagonal_summary.diagonal_report`), ``"own"`` (the module's
    ``report``) or None (its summary is written by its own run only); ``target``: what a
    population's sharpness is correlated with by default (its --target)."""

    name: str
    module: str
    help: str
    options: Dict[str, bool] = field(default_factory=dict)
    report: Optional[str] = None
    target: Optional[str] = None

    def load(self) -> ModuleType:
        """The study's module, imported."""
        return importlib.import_module(f"quotient_manifolds.experiments.{self.module}")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """The study's own options (after the common ones)."""
        self.load().add_arguments(p)

    def run(self, args: argparse.Namespace, log: Callable[[str], None]) -> int:
        """Run the study as the command line asks; returns the exit status."""
        return self.load().run(args, log)

    def own_report(self) -> Callable[..., Dict[str, Any]]:
        """The module's ``report`` (studies with ``report == "own"``)."""
        return self.load().report


#: every study, by name, in the order of ``quotient-manifolds --help``
STUDY: Dict[str, Study] = {s.name: s for s in (
    Study("diagonal", "diagonal", "diagonal linear networks: 5 data draws × 50 nets",
          dict(data=False), report="diagonal"),
    Study("text", "text", "MiniLM fine-tunes: τ of sharpness vs generalisation gap",
          dict(device=True), report="population", target="gap"),
    Study("vision", "vision", "ViT fine-tunes on Fashion-MNIST: τ vs generalisation gap",
          dict(device=True), report="population", target="gap_own"),
    Study("matched", "matched", "vision fine-tunes, every measure at the same loss rise",
          dict(device=True, bootstrap=False), report="own"),
    Study("invariance", "invariance", "sharpness ratio under GL(h) reparametrisation",
          dict(population=False)),
    Study("retraction", "retraction", "first- vs second-order vs exact geodesic"),
    Study("sam", "sam_study", "SAM / ASAM / geodesic SAM training study",
          dict(population=False, synthetic=False), report="own"),
    Study("lora", "lora", "LoRA optimizers: AdamW, peft's, the GL(r)-invariant ones",
          dict(population=False, synthetic=False), report="own"),
)}

#: the studies' names
STUDIES = tuple(STUDY)


def study(name: str) -> Study:
    """The study called ``name``; KeyError names the studies there are."""
    try:
        return STUDY[name]
    except KeyError:
        raise KeyError(f"no study {name!r}; the studies: {', '.join(STUDY)}") from None
