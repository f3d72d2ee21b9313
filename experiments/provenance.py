r"""Where a study's number comes from: the code, the software and the weights behind each record.

Every record a study writes to ``results.jsonl`` carries ``provenance`` (:func:`provenance`: the
library's version, the git commit of the code and whether it had uncommitted changes, the torch,
transformers and numpy versions, the Python version and the CPU torch runs its kernels on), and
every record of a study with checkpoints carries ``weights_sha256`` (:func:`weights_hash` of the
model's trained weights), so that two studies of the same models can be joined and checked.

``quotient-manifolds report`` reads them back (:func:`commits_of`, :func:`provenance_label`): it
refuses to pool records written by two commits of the code unless told to
(``--allow-mixed-commits``), and labels records written before records carried a commit.

Training that can be repeated bit for bit (:func:`reproducible_training`): deterministic
algorithms and a fixed number of threads while a study's model trains; the data order and the
initialisation come from the model's seed in each study.

Example::

    >>> import torch
    >>> a = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    >>> weights_hash(a) == weights_hash({"b": torch.zeros(3), "w": torch.ones(2, 3)})
    True
    >>> weights_hash(a) == weights_hash({"w": torch.ones(2, 3).double(), "b": torch.zeros(3)})
    False
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import subprocess
from importlib import metadata
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

import quotient_manifolds

__all__ = ["weights_hash", "provenance", "git_commit", "commits_of", "provenance_label",
           "reproducible_training", "TRAINING_THREADS", "UNRECORDED"]

#: the label of records written before records carried provenance
UNRECORDED = "unrecorded"


def weights_hash(state: Mapping[str, Any]) -> str:
    r"""SHA-256 (hex) of a state dict: for each tensor, in sorted name order, its name, dtype,
    shape and raw bytes (C order, on the CPU).

    The same weights give the same hash on every device and in every process; one changed bit,
    dtype, shape or name changes it. The order the dict lists its tensors in does not.

    Parameters
    ----------
    state : mapping of str to torch.Tensor
        e.g. ``model.state_dict()``, or the tensors of a safetensors checkpoint.

    Returns
    -------
    str
        64 hexadecimal digits.

    Raises
    ------
    TypeError
        if ``state`` is not a mapping or a value is not a tensor.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"weights_hash takes a state dict (name -> tensor), got a "
                        f"{type(state).__name__}; pass e.g. model.state_dict()")
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights_hash: {name!r} is a {type(t).__name__}, not a tensor; pass "
                            f"a state dict (name -> tensor), e.g. model.state_dict()")
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        # bytes through a uint8 view: numpy has no bfloat16
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def git_commit(path: Optional[str] = None) -> Tuple[Optional[str], Optional[bool]]:
    """``(commit, dirty)`` of the git checkout holding ``path`` (default: this package's source):
    the commit hash of HEAD and whether tracked files differ from it; ``(None, None)`` where the
    code is not tracked by a git checkout (an installed wheel, even inside another project's
    repository) or git is not installed."""
    here = os.path.abspath(__file__)
    where = path or os.path.dirname(here)
    try:
        if path is None:  # this file must be tracked there, not merely lie below some checkout
            subprocess.run(["git", "ls-files", "--error-unmatch", os.path.basename(here)],
                           cwd=where, capture_output=True, timeout=20, check=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                                text=True, timeout=20, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=where, capture_output=True, text=True, timeout=20,
                                check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, bool(status.strip())


def _version(package: str) -> Optional[str]:
    """The installed version of ``package`` without importing it (None if not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def provenance() -> Dict[str, Any]:
    """What a record was computed with, once per process: ``version`` (quotient-manifolds),
    ``commit`` and ``dirty`` (:func:`git_commit`; None outside a git checkout), ``torch``,
    ``transformers``, ``numpy`` (None where not installed), ``python`` and ``cpu`` (the
    instruction set torch's CPU kernels use: results can differ in the last bits between two)."""
    commit, dirty = git_commit()
    cpu = None
    try:
        cpu = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # pragma: no cover - an older torch
        pass
    return dict(version=quotient_manifolds.__version__, commit=commit, dirty=dirty,
                torch=torch.__version__, transformers=_version("transformers"),
                numpy=_version("numpy"), python=platform.python_version(),
                cpu=cpu, machine=platform.machine())


def commits_of(records: Iterable[Dict[str, Any]]) -> Dict[str, int]:
    """How many records each commit wrote: ``{commit: count}``; a commit with uncommitted
    changes is ``"<commit>+dirty"``, records without provenance count under
    :data:`UNRECORDED`, records with provenance outside a git checkout under ``"no-git"``."""
    out: Dict[str, int] = {}
    for r in records:
        p = r.get("provenance")
        if not p:
            key = UNRECORDED
        elif not p.get("commit"):
            key = "no-git"
        else:
            key = p["commit"] + ("+dirty" if p.get("dirty") else "")
        out[key] = out.get(key, 0) + 1
    return out


def provenance_label(records: Sequence[Dict[str, Any]]) -> str:
    """One line for a summary: which commit(s) and versions wrote ``records``."""
    commits = commits_of(records)
    parts: List[str] = []
    for commit, n in commits.items():
        if commit == UNRECORDED:
            parts.append(f"{n} record(s) without a recorded commit (written before records "
                         f"carried provenance)")
            continue
        first = next(r["provenance"] for r in records if r.get("provenance")
                     and commits_of([r]) == {commit: 1})
        parts.append(f"{n} record(s) from commit {commit[:12] if commit != 'no-git' else commit}"
                     f"{' (with uncommitted changes)' if commit.endswith('+dirty') else ''}: "
                     f"quotient-manifolds {first.get('version')}, torch {first.get('torch')}, "
                     f"transformers {first.get('transformers')}, numpy {first.get('numpy')}, "
                     f"CPU {first.get('cpu')}")
    hashed = sum(1 for r in records if r.get("weights_sha256"))
    if hashed:
        parts.append(f"{hashed} of {len(records)} with the SHA-256 of their weights")
    return "; ".join(parts)


#: torch threads every study's model trains with. How a sum is split over threads decides the
#: order of its float additions, so the trained weights depend on the thread count; one fixed
#: count gives the same weights on every machine with the same CPU kernels (``cpu`` of
#: :func:`provenance`) and the same software.
TRAINING_THREADS = 1


@contextlib.contextmanager
def reproducible_training(threads: int = TRAINING_THREADS) -> Iterator[Dict[str, Any]]:
    """Within the block, torch runs ``threads`` threads and deterministic algorithms
    (``torch.use_deterministic_algorithms(True, warn_only=True)``: an operation without a
    deterministic implementation warns; cuDNN deterministic, no autotuning); both are restored on
    exit. With the seeds a study draws its initialisation and data order from, training the same
    model twice gives the same weights bit for bit (the same :func:`weights_hash`).

    Parameters
    ----------
    threads : int
        torch's intra-op threads while training (default :data:`TRAINING_THREADS`).

    Yields
    ------
    dict
        ``{"threads": threads, "deterministic": True}``, for the model's training record.

    Raises
    ------
    ValueError
        if ``threads`` is not a positive integer.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    # cuBLAS is deterministic only with a fixed workspace (read when CUDA starts)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield {"threads": threads, "deterministic": True}
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=before[2])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[3], before[4]
