r"""Crash-safe execution of a population of independent jobs ("models").

Output directory layout (``--out DIR``)::

    DIR/config.json        the study, its configuration and the configuration hash
    DIR/results.jsonl      one JSON line per finished model (appended, flushed and fsync'ed)
    DIR/errors.jsonl       one line per failed model (the model is retried on the next run)
    DIR/checkpoints/       trained weights as safetensors state dicts (text/vision studies)
    DIR/summary.md, *.png  the report, rewritten at the end of every run
    DIR/.lock              held (flock) while a run is active; released by the kernel on any exit

Guarantees:

* **Resume.** A model is skipped iff ``results.jsonl`` holds a valid line with its ``model_id`` and
  the current ``config_hash``. Lines are written by the parent process only, one ``write`` per line,
  followed by ``flush`` + ``fsync``; so after any kill (SIGKILL included) at most the *last* line can
  be partial. Every line carries a SHA-256 of its own content. On load, a partial or corrupt last
  line is cut off (the file is truncated to the last good line, a copy of the removed bytes is kept
  in ``results.jsonl.corrupt``) and the model is recomputed; a corrupt line elsewhere (which an
  interrupted append cannot produce) stops the run with an error instead of being guessed at.
* **One configuration per directory.** ``config.json`` stores the hash of every setting that affects
  results (not ``--workers``, ``--out``, progress options, or the number of models: a population can
  be extended). A run whose hash differs is refused unless ``--force-mix`` is given; then results of
  both configurations live in the same file and every report uses only the current one.
* **Workers.** ``--workers N > 1`` runs models in N spawned processes, each with
  ``torch.set_num_threads(max(1, cores // N))``. Workers exit by themselves if the parent dies.
* **Traceable, repeatable.** Every line carries ``provenance`` (commit, versions); a model trains
  under :func:`~quotient_manifolds.experiments.provenance.reproducible_training` (module there).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import datetime as _dt
import errno
import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from quotient_manifolds.errors import QuotientManifoldsError

from .provenance import provenance

RESULTS = "results.jsonl"
ERRORS = "errors.jsonl"
CONFIG = "config.json"
FORMAT_VERSION = 1

# Test hook (documented): seconds to sleep after each finished model, so that a test can kill a run
# deterministically between two models. Never set in normal use.
_DELAY_ENV = "QM_EXPERIMENTS_TEST_DELAY"


class ExperimentError(QuotientManifoldsError, RuntimeError):
    """An error the CLI reports as one clear message (exit status 2), without a traceback (one of
    the library's errors, :class:`~quotient_manifolds.QuotientManifoldsError`)."""


# ------------------------------------------------------------------------------------ hashing
def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=True, default=_json_default)


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def config_hash(config: Dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:16]


def keys_hash(study: str, config: Dict[str, Any], keys: Sequence[str], **extra: Any) -> str:
    """:func:`config_hash` of ``{"study": study, the entries keys of config, **extra}``: the hash
    of what a trained model depends on (its checkpoint is named by it), e.g. the data and model
    settings and the model's hyperparameters (``hp=...``), not the sharpness settings."""
    return config_hash({"study": study, **{k: config[k] for k in keys}, **extra})


def _line_digest(record: Dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "_sha256"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def _diff_keys(a: Any, b: Any, prefix: str = "") -> List[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} -> {b!r}"]


# ------------------------------------------------------------------------------------ results
class ResultStore:
    """Append-only JSONL of per-model records with checksum, fsync and partial-line recovery."""

    def __init__(self, path: str):
        self.path = path

    def scan(self) -> Tuple[List[Dict[str, Any]], Optional[Tuple[int, bool]]]:
        """Read only: all valid records, and where a partial/corrupt LAST line starts
        (``(byte offset, terminated)``), else None. A corrupt line elsewhere cannot come from an
        interrupted write and raises :class:`ExperimentError`."""
        if not os.path.exists(self.path):
            return [], None
        with open(self.path, "rb") as fh:
            data = fh.read()
        if not data:
            return [], None
        end_ok = data.endswith(b"\n")
        lines = data.split(b"\n")
        if end_ok:
            lines = lines[:-1]
        records: List[Dict[str, Any]] = []
        offset = 0
        for i, raw in enumerate(lines):
            terminated = end_ok or i < len(lines) - 1
            rec = self._parse(raw) if terminated else None
            if rec is None:
                if terminated and raw.strip() == b"":
                    offset += len(raw) + 1
                    continue
                if i < len(lines) - 1:
                    raise ExperimentError(
                        f"{self.path}: line {i + 1} is corrupt (not valid JSON or checksum "
                        f"mismatch) and it is not the last line, so it cannot be the result of an "
                        f"interrupted write. Inspect or remove it by hand, then rerun.")
                return records, (offset, terminated)
            records.append(rec)
            offset += len(raw) + 1
        return records, None

    def load(self) -> Tuple[List[Dict[str, Any]], Optional[str]]:
        """All valid records, and a message if a partial/corrupt last line was removed (its bytes
        are kept in ``results.jsonl.corrupt`` and the file is cut before it)."""
        records, tail = self.scan()
        if tail is None:
            return records, None
        offset, terminated = tail
        with open(self.path, "rb") as fh:
            bad = fh.read()[offset:]
        with open(self.path + ".corrupt", "ab") as fh:
            fh.write(bad.rstrip(b"\n") + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        with open(self.path, "r+b") as fh:
            fh.truncate(offset)
            fh.flush()
            os.fsync(fh.fileno())
        why = "corrupt" if terminated else "unterminated (partial write)"
        return records, (f"removed a {why} last line ({len(bad)} bytes) from {self.path}; "
                         f"its model will be recomputed (bytes kept in "
                         f"{os.path.basename(self.path)}.corrupt)")

    @staticmethod
    def _parse(raw: bytes) -> Optional[Dict[str, Any]]:
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(rec, dict) or rec.get("_sha256") != _line_digest(rec):
            return None
        return rec

    def append(self, record: Dict[str, Any]) -> None:
        record = dict(record)
        record["_sha256"] = _line_digest(record)
        line = (canonical_json(record) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(line)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:    # a partial line is cut by the next run (ResultStore.load)
            raise naming(err, self.path) from None


# ------------------------------------------------------------------------------------ output dir
class OutputDir:
    """Validates/creates DIR, holds the run lock and the configuration check."""

    def __init__(self, path: str, study: str, config: Dict[str, Any], *, force_mix: bool = False):
        self.path = os.path.abspath(path)
        self.study = study
        self.config = config
        self.hash = config_hash({"study": study, **config})
        self.force_mix = force_mix
        self._lock_fh = None

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def __enter__(self) -> "OutputDir":
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ExperimentError(f"--out {self.path} exists and is not a directory")
        os.makedirs(self.path, exist_ok=True)
        self._lock()
        try:
            self._check_config()
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._unlock()

    def _lock(self) -> None:
        import fcntl  # POSIX only: imported where the lock is taken
        fh = open(self.file(".lock"), "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise ExperimentError(f"another run is using {self.path} (lock held on "
                                  f"{self.file('.lock')}); wait for it or use another --out")
        self._lock_fh = fh

    def _unlock(self) -> None:
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None

    def _check_config(self) -> None:
        path = self.file(CONFIG)
        now = _dt.datetime.now().isoformat(timespec="seconds")
        entry = {"study": self.study, "config_hash": self.hash, "config": self.config}
        if os.path.exists(path):
            try:
                with open(path) as fh:
                    old = json.load(fh)
                old_hash = old["config_hash"]
            except (OSError, ValueError, KeyError) as err:
                raise ExperimentError(f"{path} is unreadable ({err}); this does not look like an "
                                      f"output directory of this tool. Use another --out.")
            known = {old_hash, *[h["config_hash"] for h in old.get("other_configs", [])]}
            if self.hash in known:
                if old_hash != self.hash:  # switching back to an earlier config of a mixed dir
                    self._write_config(old, entry, now)
                return
            if not self.force_mix:
                diff = _diff_keys({"study": old.get("study"), **old.get("config", {})},
                                  {"study": self.study, **self.config})
                shown = "\n  ".join(diff[:12]) + ("\n  ..." if len(diff) > 12 else "")
                raise ExperimentError(
                    f"{self.path} holds results of a different configuration (hash {old_hash}, "
                    f"this run {self.hash}). Differences:\n  {shown}\nUse another --out, or pass "
                    f"--force-mix to keep both configurations in this directory (reports then use "
                    f"only the current one).")
            self._write_config(old, entry, now)
        else:
            with contextlib.suppress(FileNotFoundError):
                if os.path.getsize(self.file(RESULTS)) > 0 and not self.force_mix:
                    raise ExperimentError(f"{self.path} has {RESULTS} but no {CONFIG}; refusing to "
                                          f"mix unknown results (use another --out or --force-mix)")
            self._atomic_json(path, {**entry, "created": now, "format_version": FORMAT_VERSION,
                                     "other_configs": []})

    def record_in_config(self, key: str, value: Any) -> None:
        """Write ``value`` under ``key`` beside the configuration in config.json, outside the
        hashed ``config``: what a run resolved from it (e.g. the calibrated ρ), recorded without
        changing the hash, so directories of earlier runs stay resumable."""
        if key in ("study", "config_hash", "config", "created", "format_version",
                   "other_configs"):
            raise ValueError(f"{key!r} is one of config.json's own fields; pick another key")
        with open(self.file(CONFIG)) as fh:
            current = json.load(fh)
        self._atomic_json(self.file(CONFIG), {**current, key: value})

    def _write_config(self, old: Dict[str, Any], entry: Dict[str, Any], now: str) -> None:
        others = [h for h in old.get("other_configs", []) if h["config_hash"] != entry["config_hash"]]
        others.append({k: old[k] for k in ("study", "config_hash", "config") if k in old})
        self._atomic_json(self.file(CONFIG), {**entry, "created": now,
                                              "format_version": FORMAT_VERSION,
                                              "other_configs": others})

    @staticmethod
    def _atomic_json(path: str, obj: Any) -> None:
        atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True,
                                             default=_json_default) + "\n").encode())


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file beside it, fsynced, then
    renamed over it). A failed write (a full disk, a read-only directory) leaves ``path`` as it
    was and no temporary file behind, and its ``OSError`` names ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise naming(err, path, instead_of=tmp) from None
    with contextlib.suppress(OSError):
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def naming(err: OSError, path: str, instead_of: Optional[str] = None) -> OSError:
    """``err`` with ``path`` as its file name where it has none (an error of ``write`` or
    ``fsync`` on an open descriptor names no file) or names ``instead_of`` (a temporary file the
    user never asked for)."""
    if err.filename is not None and err.filename != instead_of:
        return err
    named = type(err)(err.errno, err.strerror or str(err), path)
    named.__traceback__ = err.__traceback__
    return named


#: what to do about a failed write, by errno
_WRITE_FIXES = {
    errno.ENOSPC: "free disk space there (or pass --out DIR on another disk), then rerun: finished "
                  "models are kept in results.jsonl and the run resumes",
    errno.EDQUOT: "free space within your disk quota (or pass --out DIR elsewhere), then rerun: the "
                  "run resumes",
    errno.EROFS: "the file system is read-only: pass --out DIR (and --checkpoint-dir DIR) on a "
                 "writable one",
    errno.EACCES: "the directory is not writable by you: pass --out DIR on a writable one, or fix "
                  "its permissions",
    errno.EPERM: "the directory is not writable by you: pass --out DIR on a writable one, or fix "
                 "its permissions",
}


def fault_message(err: OSError) -> str:
    """One line for an ``OSError`` that ends a command: the path, what happened and what to do."""
    path = err.filename if err.filename is not None else "a file"
    what = err.strerror or type(err).__name__
    fix = _WRITE_FIXES.get(err.errno)
    return f"{display_path(path) if isinstance(path, str) else path}: {what}" + (f"; {fix}" if fix else "")


def progress_bar(**kwargs):
    """The studies' progress bar, ``tqdm.auto.tqdm(dynamic_ncols=True, **kwargs)``. tqdm comes with
    the [experiments] extra: imported when a bar is drawn, so the command line starts without it."""
    from tqdm.auto import tqdm
    return tqdm(**{"dynamic_ncols": True, **kwargs})


def display_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (records and reports get
    committed: no machine paths in them)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def study_device(config: Dict[str, Any]):
    """The torch device a population trains and measures on: ``config["device"]`` (set by
    ``--device``; absent = CPU, so that CPU configurations keep their hash)."""
    return torch.device(config.get("device", "cpu"))


# ------------------------------------------------------------------------------------ execution
def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


_PARENT_PID: Optional[int] = None


def _init_worker(threads: int, parent_pid: int) -> None:
    global _PARENT_PID
    _PARENT_PID = parent_pid
    _exit_with_parent()
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def check_parent_alive() -> None:
    """A worker whose parent died (e.g. SIGKILL) exits (called by the watchdog thread of
    :func:`_exit_with_parent`, and from training/measurement loops)."""
    if _PARENT_PID is not None and os.getppid() != _PARENT_PID:
        os._exit(3)


#: How often a worker's watchdog thread checks that its parent is alive (seconds).
PARENT_POLL_S = 0.2


def _exit_with_parent() -> None:
    """Make this worker exit when the parent dies, whatever it is doing (computing, or idle waiting
    for the next model: the pool's queues never report a dead parent, so an idle worker would wait
    forever, and with it the multiprocessing resource tracker, which lives until every process
    holding its pipe is gone). Two layers: on Linux the kernel sends SIGKILL at the parent's death
    (``prctl(PR_SET_PDEATHSIG)``); everywhere, a daemon thread polls ``os.getppid()``, which
    changes when the parent dies (the worker is re-parented)."""
    if sys.platform.startswith("linux"):
        # no libc (OSError) or no prctl in it (AttributeError) only removes this layer
        with contextlib.suppress(OSError, AttributeError):
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def watch() -> None:
        while True:
            check_parent_alive()
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
    check_parent_alive()   # the parent may have died before prctl took effect


def _call(job: Callable, args: tuple) -> Tuple[bool, Any]:
    try:
        return True, job(*args)
    except OSError as err:
        if err.errno in _WRITE_FIXES:    # a full disk, a read-only directory: every next model
            raise                        # would fail the same way; the run stops (cli: one line)
        return False, traceback.format_exc()
    except Exception:  # noqa: BLE001 - recorded: the parent writes the traceback to errors.jsonl and
        return False, traceback.format_exc()  # logs the model as FAILED (run_population's finish)


def run_population(outdir: OutputDir, job: Callable, model_ids: Iterable[int], job_args: tuple, *,
                   workers: int = 1, progress: bool = True, log: Callable[[str], None] = print,
                   desc: str = "models", threads: Optional[int] = None, results: str = RESULTS
                   ) -> Tuple[List[Dict[str, Any]], List[int]]:
    """Run ``job(model_id, *job_args) -> record`` for every model id not yet done.

    Returns (all current-config records sorted by model id, failed model ids). Records are appended
    to ``results`` (default ``results.jsonl``; the ρ calibration keeps its pilot records in its own
    file) by this (the parent) process as soon as each model finishes. Worker processes use
    ``threads`` torch threads each (default max(1, cores // workers)).
    """
    store = ResultStore(outdir.file(results))
    records, note = store.load()
    if note:
        log(f"warning: {note}")
    done = {r["model_id"]: r for r in records if r.get("config_hash") == outdir.hash}
    ids = list(model_ids)
    pending = [i for i in ids if i not in done]
    if done:
        log(f"resuming: {len([i for i in ids if i in done])} of {len(ids)} models already in "
            f"{store.path}; {len(pending)} to run")
    failed: List[int] = []
    delay = float(os.environ.get(_DELAY_ENV, "0") or 0)

    def finish(model_id: int, ok: bool, value: Any) -> None:
        if ok:
            value.update(model_id=model_id, config_hash=outdir.hash, study=outdir.study,
                         format_version=FORMAT_VERSION, provenance=provenance(),
                         finished=_dt.datetime.now().isoformat(timespec="seconds"))
            store.append(value)
            done[model_id] = value
        else:
            failed.append(model_id)
            ResultStore(outdir.file(ERRORS)).append(
                {"model_id": model_id, "config_hash": outdir.hash, "traceback": value,
                 "time": _dt.datetime.now().isoformat(timespec="seconds")})
            log(f"model {model_id} FAILED (see {outdir.file(ERRORS)}):\n{value.strip().splitlines()[-1]}")
        if delay:
            time.sleep(delay)

    bar = None
    if progress and pending:
        bar = progress_bar(total=len(pending), desc=desc, unit="model", position=0, leave=True)
    try:
        if workers <= 1 or len(pending) <= 1:
            for i in pending:
                ok, value = _call(job, (i, *job_args))
                finish(i, ok, value)
                if bar is not None:
                    bar.update(1)
        else:
            threads = threads or max(1, cores() // workers)
            # spawned workers inherit the environment: cap BLAS threads before numpy loads there
            for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
                os.environ.setdefault(var, str(threads))
            ctx = mp.get_context("spawn")
            pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                          initializer=_init_worker,
                                          initargs=(threads, os.getpid()))
            clean = False
            try:
                futures = {pool.submit(_call, job, (i, *job_args)): i for i in pending}
                for fut in cf.as_completed(futures):
                    ok, value = fut.result()
                    finish(futures[fut], ok, value)
                    if bar is not None:
                        bar.update(1)
                clean = True
            finally:
                pool.shutdown(wait=clean, cancel_futures=True)
    finally:
        if bar is not None:
            bar.close()
    current = sorted((done[i] for i in ids if i in done), key=lambda r: r["model_id"])
    return current, failed


def load_current(outdir_path: str, config_hash_: str) -> List[Dict[str, Any]]:
    records, _ = ResultStore(os.path.join(outdir_path, RESULTS)).load()
    return sorted((r for r in records if r.get("config_hash") == config_hash_),
                  key=lambda r: r["model_id"])


def fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    if s < 90:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min"
