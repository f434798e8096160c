"""Datasets as in-memory tensors, client partitioners and a fast minibatch iterator.

``load_dataset(name, **options) -> (train, test)``, each a frozen ``Split`` (``x`` float32 ``(N, C, H, W)``,
normalised with statistics of the train split; ``y`` int64 ``(N,)``). Registry ``DATASETS``:

* ``"digits"`` (default): scikit-learn's bundled 8x8 digits (1,797 images, shipped inside the scikit-learn
  package, nothing is downloaded), stratified, seeded train/test split;
* ``"cifar10"``: a local ``cifar-10-batches-py`` folder (``root`` option), read with a restricted unpickler that
  only reconstructs numpy arrays;
* ``"hf"`` (or ``"hf:<dataset>"``): a Hugging Face dataset through flwr-datasets, for users who are online.

Registry ``PARTITIONERS``: ``"iid"`` and ``"dirichlet"`` (label skew), called as
``PARTITIONERS.build("dirichlet", alpha=0.3, seed=0)(labels, num_parts)``; both return disjoint int64 index arrays
that together cover every sample once.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcomp.registry import Registry


class DatasetError(ValueError):
    """A dataset could not be loaded: bad contents, unreachable source, or a refused pickle."""


class UnsafePickleError(DatasetError, pickle.UnpicklingError):
    """A pickle asked for a global outside the numpy-array allow-list; nothing from it was executed."""


# --------------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class Split(torch.utils.data.Dataset):
    """One split in memory: ``x`` float32 ``(N, C, H, W)``, ``y`` int64 ``(N,)`` in ``[0, num_classes)``.

    A torch ``Dataset`` of ``(input, label)`` items: the built-in datasets meet the plug-in contract."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if self.x.dtype != torch.float32 or self.x.ndim != 4:
            raise DatasetError(f"{self.name}: x must be float32 (N, C, H, W), got {self.x.dtype} {tuple(self.x.shape)}")
        if self.y.dtype != torch.int64 or self.y.ndim != 1 or len(self.y) != len(self.x):
            raise DatasetError(f"{self.name}: y must be int64 (N,) with N = {len(self.x)}, got {tuple(self.y.shape)}")
        if len(self.y) and (int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes):
            raise DatasetError(f"{self.name}: labels outside [0, {self.num_classes})")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int | Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input, label)`` of one sample, or ``(inputs, labels)`` of a list of indices (one tensor index per
        batch: what ``fedcomp.task.training.loader`` feeds it, without a per-sample Python loop)."""
        if isinstance(index, int):
            return self.x[index], self.y[index]
        idx = torch.as_tensor(index, dtype=torch.int64)
        return self.x[idx], self.y[idx]

    @property
    def targets(self) -> torch.Tensor:
        """The labels (the name torchvision datasets use; partitioners read it)."""
        return self.y

    @property
    def in_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``: what ``build_model`` takes."""
        return tuple(self.x.shape[1:])  # type: ignore[return-value]

    def subset(self, indices: np.ndarray | torch.Tensor | Sequence[int]) -> Split:
        """The samples at ``indices`` (e.g. one client's partition)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return Split(self.x[idx], self.y[idx], self.num_classes, self.name)


def _normalize(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel standardisation of (N, C, H, W) arrays with the train split's mean and std."""
    mean = train.mean(axis=(0, 2, 3), keepdims=True)
    std = train.std(axis=(0, 2, 3), keepdims=True)
    std = np.where(std > 0, std, 1.0)
    return ((train - mean) / std).astype(np.float32), ((test - mean) / std).astype(np.float32)


def _splits(
    name: str, num_classes: int, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray, normalize: bool
) -> tuple[Split, Split]:
    xtr, xte = xtr.astype(np.float32), xte.astype(np.float32)
    if normalize:
        xtr, xte = _normalize(xtr, xte)

    def make(x: np.ndarray, y: np.ndarray) -> Split:
        return Split(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64)), num_classes, name)

    return make(xtr, ytr), make(xte, yte)


# ------------------------------------------------------------------------------------------------- datasets

DATASETS: Registry[Any] = Registry("dataset")


@DATASETS.register("digits")
class Digits:
    """scikit-learn's 8x8 digits: pixels scaled to [0, 1], then standardised with train statistics.

    ``test_fraction`` of every class goes to the test split (stratified); the split depends only on ``seed``.
    """

    @dataclass(frozen=True)
    class Config:
        test_fraction: float = 0.2
        seed: int = 0
        normalize: bool = True

        def __post_init__(self) -> None:
            if not 0.0 < self.test_fraction < 1.0:
                raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")

    def __init__(self, config: Config) -> None:
        self.config = config

    def load(self) -> tuple[Split, Split]:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        bunch = load_digits()
        x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
        y = bunch.target.astype(np.int64)
        xtr, xte, ytr, yte = train_test_split(
            x, y, test_size=self.config.test_fraction, random_state=self.config.seed, stratify=y
        )
        return _splits("digits", 10, xtr, ytr, xte, yte, self.config.normalize)


_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),  # numpy's pickle protocol-5 path
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 3 writes bytes at protocol 2; resolved to a latin-1-only function
}


def _latin1_bytes(text: str, encoding: str = "utf-8") -> bytes:
    """Stand-in for ``_codecs.encode`` in a protocol-2 pickle: only the latin-1 text→bytes that pickle emits."""
    if not isinstance(text, str) or encoding.replace("-", "").replace("_", "").lower() != "latin1":
        raise UnsafePickleError(f"refusing _codecs.encode with encoding {encoding!r}: only latin-1 bytes are allowed")
    return text.encode("latin-1")


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals numpy needs to rebuild arrays (plus a latin-1-only ``_codecs.encode`` for bytes
    written by Python 3 at protocol 2); any other global is refused before it is imported or called."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file, encoding="bytes")  # the official files are Python 2 pickles
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"{self.source}: refusing to load global {module}.{name} from a pickle; only numpy array "
                "reconstruction is allowed (is this really a CIFAR-10 batch file?)"
            )
        if name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "_codecs":
            return _latin1_bytes
        try:  # numpy >= 2 moved numpy.core to numpy._core; resolve without touching the deprecated alias
            from numpy._core import multiarray, numeric
        except ImportError:  # pragma: no cover - numpy 1.x
            from numpy.core import multiarray, numeric  # type: ignore[no-redef]
        return getattr(multiarray if name == "_reconstruct" else numeric, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickle batch → (uint8 (N, 3, 32, 32), int64 (N,)), validated."""
    with path.open("rb") as f:
        try:
            obj = _NumpyOnlyUnpickler(f, str(path.name)).load()
        except UnsafePickleError:
            raise
        except Exception as exc:  # truncated or corrupt file
            raise DatasetError(f"{path.name}: not a readable CIFAR-10 batch ({exc})") from exc
    if not isinstance(obj, dict):
        raise DatasetError(f"{path.name}: expected a dict, got {type(obj).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    if "data" not in batch or "labels" not in batch:
        raise DatasetError(f"{path.name}: missing 'data' or 'labels' (keys: {sorted(map(str, batch))})")
    data, labels = batch["data"], batch["labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DatasetError(f"{path.name}: 'data' must be a uint8 array of shape (N, 3072), got {shape}")
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{path.name}: 'labels' must be integers ({exc})") from exc
    if y.shape != (data.shape[0],):
        raise DatasetError(f"{path.name}: {len(y)} labels for {data.shape[0]} images")
    if y.size and (y.min() < 0 or y.max() > 9):
        raise DatasetError(f"{path.name}: labels must be in 0..9, got range {y.min()}..{y.max()}")
    return data.reshape(-1, 3, 32, 32), y


@DATASETS.register("cifar10")
class Cifar10:
    """CIFAR-10 from a local folder in the python "pickle batches" layout (``data_batch_1..5``, ``test_batch``).

    ``root``: the folder the user names (``dataset-options "root=/data/cifar-10-batches-py"``; the official
    archive unpacks to ``cifar-10-batches-py``). Pixels are scaled to [0, 1]
    and standardised per channel with train statistics. Files are read with an unpickler that allows only numpy
    array reconstruction (``UnsafePickleError`` otherwise), then shapes and labels are validated.
    """

    @dataclass(frozen=True)
    class Config:
        root: str = "data/cifar-10-batches-py"
        normalize: bool = True
        path: str = ""  # the old name of ``root``; wins when given

    TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
    TEST_FILE = "test_batch"

    def __init__(self, config: Config) -> None:
        self.config = config

    def load(self) -> tuple[Split, Split]:
        root = Path(self.config.path or self.config.root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(
                f"CIFAR-10 folder {str(root)!r} not found; pass root=<folder with data_batch_1..5 and test_batch> "
                "(the python version of the dataset, unpacked)"
            )
        missing = [n for n in (*self.TRAIN_FILES, self.TEST_FILE) if not (root / n).is_file()]
        if missing:
            raise FileNotFoundError(f"CIFAR-10 folder {str(root)!r} lacks {', '.join(missing)}")
        parts = [_read_cifar_batch(root / n) for n in self.TRAIN_FILES]
        xtr = np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0
        ytr = np.concatenate([p[1] for p in parts])
        xte, yte = _read_cifar_batch(root / self.TEST_FILE)
        return _splits("cifar10", 10, xtr, ytr, xte.astype(np.float32) / 255.0, yte, self.config.normalize)


@DATASETS.register("hf")
class HuggingFace:
    """A Hugging Face image-classification dataset through flwr-datasets (``pip install fedcomp[datasets]``).

    ``load_dataset("hf:uoft-cs/cifar10")`` is ``load_dataset("hf", dataset="uoft-cs/cifar10")``. Needs network
    access to the hub on first use; raises ``ImportError`` without flwr-datasets and ``DatasetError`` when the
    hub cannot be reached. ``image_key``/``label_key`` default to the first of the usual column names found.
    """

    @dataclass(frozen=True)
    class Config:
        dataset: str = ""
        train_split: str = "train"
        test_split: str = "test"
        image_key: str = ""
        label_key: str = ""
        normalize: bool = True

        def __post_init__(self) -> None:
            if not self.dataset:
                raise ValueError("name the dataset: 'hf:<dataset>' or dataset=<hub id>")

    IMAGE_KEYS = ("img", "image", "pixel_values")
    LABEL_KEYS = ("label", "labels", "fine_label")

    def __init__(self, config: Config) -> None:
        self.config = config

    def load(self) -> tuple[Split, Split]:
        try:
            from flwr_datasets import FederatedDataset
        except ImportError as exc:
            raise ImportError(
                f"dataset 'hf:{self.config.dataset}' needs flwr-datasets: pip install 'fedcomp[datasets]' "
                "(and network access to the Hugging Face hub); offline, use 'digits' or a local 'cifar10' folder"
            ) from exc
        cfg = self.config
        try:
            fds = FederatedDataset(dataset=cfg.dataset, partitioners={cfg.train_split: 1})
            train, test = fds.load_split(cfg.train_split), fds.load_split(cfg.test_split)
        except (OSError, ConnectionError) as exc:  # requests/huggingface_hub errors derive from OSError
            raise DatasetError(
                f"could not load 'hf:{cfg.dataset}' from the Hugging Face hub ({type(exc).__name__}: {exc}); "
                "check the network, or use 'digits' or a local 'cifar10' folder"
            ) from exc
        xtr, ytr = self._arrays(train)
        xte, yte = self._arrays(test)
        num_classes = int(max(ytr.max(), yte.max())) + 1
        return _splits(f"hf:{cfg.dataset}", num_classes, xtr, ytr, xte, yte, cfg.normalize)

    def _key(self, columns: Sequence[str], given: str, candidates: Sequence[str], what: str) -> str:
        if given:
            return given
        for k in candidates:
            if k in columns:
                return k
        raise DatasetError(f"hf:{self.config.dataset}: no {what} column among {list(columns)}; pass {what}_key")

    def _arrays(self, ds: Any) -> tuple[np.ndarray, np.ndarray]:
        columns = list(ds.column_names)
        ikey = self._key(columns, self.config.image_key, self.IMAGE_KEYS, "image")
        lkey = self._key(columns, self.config.label_key, self.LABEL_KEYS, "label")
        x = np.stack([np.asarray(img) for img in ds[ikey]]).astype(np.float32)
        if x.ndim == 3:  # grayscale (N, H, W)
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):  # channels-last
            x = x.transpose(0, 3, 1, 2)
        if x.max() > 1.0:
            x = x / 255.0
        return x, np.asarray(ds[lkey], dtype=np.int64)


def load_dataset(name: str = "digits", **options: Any) -> tuple[Split, Split]:
    """``(train, test)`` splits of dataset ``name`` from ``DATASETS``; ``"hf:<id>"`` selects the hub loader."""
    if name.startswith("hf:"):
        name, options = "hf", {"dataset": name[3:], **options}
    return DATASETS.build(name, **options).load()


# ---------------------------------------------------------------------------------------------- partitions


def _check_parts(n: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if n < num_parts:
        raise ValueError(f"cannot split {n} samples into {num_parts} non-empty parts")


def partition_iid(n: int, num_parts: int, seed: int = 0) -> list[np.ndarray]:
    """A seeded random permutation of ``range(n)`` cut into ``num_parts`` parts whose sizes differ by at most 1.

    Each part is sorted (int64).
    """
    _check_parts(n, num_parts)
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_parts)]


def partition_dirichlet(
    labels: np.ndarray | torch.Tensor | Sequence[int],
    num_parts: int,
    alpha: float,
    seed: int = 0,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed parts: for every class, its samples are shared out by proportions drawn from Dir(alpha).

    Small ``alpha`` (0.1) gives each part few dominant classes; large ``alpha`` (100) approaches IID. Draws are
    repeated until every part has at least ``min_size`` samples (``ValueError`` after ``max_tries``). Each part
    is sorted (int64); the result depends only on ``labels``, ``num_parts``, ``alpha``, ``seed`` and ``min_size``.
    """
    y = np.asarray(labels).reshape(-1)
    n = len(y)
    _check_parts(n, num_parts)
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be finite and > 0, got {alpha}")
    if min_size * num_parts > n:
        raise ValueError(f"min_size={min_size} x {num_parts} parts exceeds {n} samples")
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
        for idx in by_class:
            idx = rng.permutation(idx)
            props = rng.dirichlet(np.full(num_parts, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(np.int64)
            for part, chunk in zip(parts, np.split(idx, cuts), strict=True):
                part.append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw gave every one of {num_parts} parts >= {min_size} samples in "
        f"{max_tries} tries; lower min_size or num_parts, or raise alpha"
    )


PARTITIONERS: Registry[Any] = Registry("partitioner")


@PARTITIONERS.register("iid")
class IidPartitioner:
    """``partition_iid`` as a registry entry: ``(labels, num_parts) -> list of index arrays``."""

    @dataclass(frozen=True)
    class Config:
        seed: int = 0

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, labels: np.ndarray | torch.Tensor | Sequence[int], num_parts: int) -> list[np.ndarray]:
        return partition_iid(len(labels), num_parts, self.config.seed)


@PARTITIONERS.register("dirichlet")
class DirichletPartitioner:
    """``partition_dirichlet`` as a registry entry; ``alpha`` defaults to 0.5."""

    @dataclass(frozen=True)
    class Config:
        alpha: float = 0.5
        seed: int = 0
        min_size: int = 1

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, labels: np.ndarray | torch.Tensor | Sequence[int], num_parts: int) -> list[np.ndarray]:
        c = self.config
        return partition_dirichlet(labels, num_parts, c.alpha, c.seed, c.min_size)


def partition(
    name: str, labels: np.ndarray | torch.Tensor | Sequence[int], num_parts: int, **options: Any
) -> list[np.ndarray]:
    """``PARTITIONERS.build(name, **options)(labels, num_parts)``."""
    return PARTITIONERS.build(name, **options)(labels, num_parts)


# ------------------------------------------------------------------------------------------------- batches


def batches(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of ``(x_batch, y_batch)`` minibatches, shuffled by ``generator`` (or a fresh one from ``seed``).

    In-process tensor indexing: no DataLoader, no worker processes. Pass the same ``generator`` across epochs to
    get a new, reproducible order each epoch.
    """
    n = len(x)
    if len(y) != n:
        raise ValueError(f"x has {n} samples but y has {len(y)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        yield x[idx], y[idx]
