"""Datasets (digits, local CIFAR-10 with a restricted unpickler, flwr-datasets error paths), partitioners, batches."""

from __future__ import annotations

import codecs
import os
import pickle
import struct
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.registry import ConfigError
from fedcomp.task.data import (
    DATASETS,
    PARTITIONERS,
    DatasetError,
    Split,
    UnsafePickleError,
    batches,
    load_dataset,
    partition,
    partition_dirichlet,
    partition_iid,
)

# ------------------------------------------------------------------------------------------------ digits


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_registry_names():
    assert {"digits", "mnist1d", "cifar10", "hf"} <= set(DATASETS.names())
    assert {"iid", "dirichlet"} <= set(PARTITIONERS.names())


def test_digits_sizes_and_normalisation(digits):
    train, test = digits
    assert (len(train), len(test)) == (1437, 360)
    for s in (train, test):
        assert s.x.dtype == torch.float32 and s.y.dtype == torch.int64
        assert s.x.shape[1:] == (1, 8, 8) and s.in_shape == (1, 8, 8)
        assert s.num_classes == 10 and s.name == "digits"
        assert set(s.y.tolist()) == set(range(10))
    assert abs(train.x.mean().item()) < 1e-4
    assert abs(train.x.std().item() - 1.0) < 1e-3
    assert abs(test.x.mean().item()) < 0.1  # test uses train statistics


def test_digits_raw_values_in_unit_interval():
    train, test = load_dataset("digits", normalize=False)
    assert train.x.min() >= 0 and train.x.max() <= 1 and train.x.max() == 1.0


def test_digits_split_deterministic_and_seeded(digits):
    again = load_dataset("digits")
    for a, b in zip(digits, again, strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    other, _ = load_dataset("digits", seed=1)
    assert not torch.equal(other.y, digits[0].y)


def test_digits_split_stratified(digits):
    train, test = digits
    total = np.bincount(np.concatenate([train.y.numpy(), test.y.numpy()]), minlength=10)
    in_test = np.bincount(test.y.numpy(), minlength=10)
    assert np.all(np.abs(in_test - 0.2 * total) <= 1)


def test_dataset_options_validated():
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.5)
    with pytest.raises(ConfigError, match="unknown option"):
        load_dataset("digits", seeed=1)
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_dataset("mnist-but-not-here")


def test_split_validation_and_subset(digits):
    train, _ = digits
    sub = train.subset(np.array([3, 1, 4]))
    assert torch.equal(sub.y, train.y[[3, 1, 4]]) and len(sub) == 3
    with pytest.raises(DatasetError):
        Split(train.x[:3], train.y[:2], 10, "bad")
    with pytest.raises(DatasetError):
        Split(train.x[:3].double(), train.y[:3], 10, "bad")
    with pytest.raises(DatasetError, match="labels"):
        Split(train.x[:3], torch.tensor([0, 1, 10]), 10, "bad")


# ---------------------------------------------------------------------------------------------- cifar10


class _Py2Pickler(pickle._Pickler):
    """Writes ``bytes`` as Python 2 ``str`` opcodes (SHORT_BINSTRING/BINSTRING), as in the official CIFAR files."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_str8(self, obj):
        n = len(obj)
        head = pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)
        self.write(head + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_str8


def _write_batch(path, data, labels, protocol=pickle.DEFAULT_PROTOCOL, bytes_keys=False):
    batch = {"batch_label": "synthetic", "data": data, "labels": labels, "filenames": ["f"] * len(labels)}
    if bytes_keys:  # what Python 2 pickles look like when read with encoding="bytes"
        batch = {k.encode(): v for k, v in batch.items()}
    with open(path, "wb") as f:
        if protocol == "py2":
            _Py2Pickler(f, protocol=2).dump(batch)
        else:
            pickle.dump(batch, f, protocol=protocol)


def _cifar_folder(root, n_train=4, n_test=3, **kw):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for i in range(1, 6):
        data = rng.integers(0, 256, (n_train, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n_train)]
        _write_batch(root / f"data_batch_{i}", data, labels, **kw)
        arrays[f"data_batch_{i}"] = (data, labels)
    data = rng.integers(0, 256, (n_test, 3072), dtype=np.uint8)
    labels = np.arange(n_test, dtype=np.int64) % 10  # a numpy array also works as labels
    _write_batch(root / "test_batch", data, labels, **kw)
    arrays["test_batch"] = (data, labels)
    return arrays


@pytest.mark.parametrize("protocol, bytes_keys", [("py2", True), (2, False), (4, False), (5, False)])
def test_cifar_loads_synthetic_folder(tmp_path, protocol, bytes_keys):
    arrays = _cifar_folder(tmp_path / "c", protocol=protocol, bytes_keys=bytes_keys)
    train, test = load_dataset("cifar10", path=str(tmp_path / "c"), normalize=False)
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (3, 3, 32, 32)
    assert train.num_classes == 10 and train.name == "cifar10"
    d1, l1 = arrays["data_batch_1"]
    # row layout: 1024 red, 1024 green, 1024 blue values, each row-major 32x32
    assert train.x[0, 1, 2, 3].item() == pytest.approx(d1[0, 1024 + 2 * 32 + 3] / 255.0)
    assert train.y[:4].tolist() == l1
    d5, _ = arrays["data_batch_5"]
    assert torch.allclose(train.x[16:20].reshape(4, -1), torch.from_numpy(d5).float() / 255.0)
    assert test.y.tolist() == [0, 1, 2]


def test_cifar_from_the_folder_the_run_config_names(tmp_path):
    """``dataset-options "root=..."`` reaches the loader: any folder, no pickle beyond numpy arrays."""
    from fedcomp.task.config import RunConfig
    from fedcomp.task.training import datasets

    _cifar_folder(tmp_path / "my data")
    run = RunConfig(dataset="cifar10", dataset_options=f"root='{tmp_path / 'my data'}',normalize=false", model="cnn")
    train, test = datasets(run)
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (3, 3, 32, 32)
    with pytest.raises(FileNotFoundError, match="root="):
        datasets(RunConfig(dataset="cifar10", dataset_options=f"root={tmp_path / 'nowhere'}"))


def test_cifar_normalised_per_channel(tmp_path):
    _cifar_folder(tmp_path)
    train, test = load_dataset("cifar10", path=str(tmp_path))
    mean = train.x.mean(dim=(0, 2, 3))
    std = train.x.std(dim=(0, 2, 3), unbiased=False)
    assert torch.allclose(mean, torch.zeros(3), atol=1e-5) and torch.allclose(std, torch.ones(3), atol=1e-4)


def test_cifar_missing_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_dataset("cifar10", path=str(tmp_path / "nowhere"))
    _cifar_folder(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_dataset("cifar10", path=str(tmp_path))


class _RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _RunsEval:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("evil", [_RunsShell, _RunsEval])
@pytest.mark.parametrize("where", ["labels", "top"])
def test_cifar_malicious_pickle_refused_not_executed(tmp_path, evil, where):
    _cifar_folder(tmp_path)
    marker = tmp_path / "pwned"
    payload = evil(marker)
    obj = payload if where == "top" else {"data": np.zeros((2, 3072), np.uint8), "labels": payload}
    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump(obj, f)
    with pytest.raises(UnsafePickleError, match="refusing to load global") as info:
        load_dataset("cifar10", path=str(tmp_path))
    assert "data_batch_2" in str(info.value)
    assert isinstance(info.value, pickle.UnpicklingError)
    assert not marker.exists()


def test_cifar_other_globals_refused(tmp_path):
    _cifar_folder(tmp_path)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({"data": np.zeros((1, 3072), np.uint8), "labels": [0], "extra": types.SimpleNamespace()}, f)
    with pytest.raises(UnsafePickleError, match="types.SimpleNamespace"):
        load_dataset("cifar10", path=str(tmp_path))


def test_cifar_codecs_only_latin1(tmp_path):
    class Rot13:
        def __reduce__(self):
            return (codecs.encode, ("abc", "rot13"))

    _cifar_folder(tmp_path)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({"data": np.zeros((1, 3072), np.uint8), "labels": [0], "x": Rot13()}, f, protocol=2)
    with pytest.raises(UnsafePickleError, match="latin-1"):
        load_dataset("cifar10", path=str(tmp_path))


@pytest.mark.parametrize(
    "data, labels, match",
    [
        (np.zeros((2, 3000), np.uint8), [0, 1], r"\(N, 3072\)"),
        (np.zeros((2, 3072), np.float32), [0, 1], "uint8"),
        (np.zeros((2, 3072), np.uint8), [0, 10], "0..9"),
        (np.zeros((2, 3072), np.uint8), [0, -1], "0..9"),
        (np.zeros((2, 3072), np.uint8), [0], "1 labels for 2 images"),
        (np.zeros((2, 3072), np.uint8), ["a", "b"], "integers"),
    ],
)
def test_cifar_bad_contents(tmp_path, data, labels, match):
    _cifar_folder(tmp_path)
    _write_batch(tmp_path / "data_batch_4", data, labels)
    with pytest.raises(DatasetError, match=match):
        load_dataset("cifar10", path=str(tmp_path))


def test_cifar_corrupt_or_wrong_type(tmp_path):
    _cifar_folder(tmp_path)
    (tmp_path / "data_batch_1").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(DatasetError, match="data_batch_1"):
        load_dataset("cifar10", path=str(tmp_path))
    with open(tmp_path / "data_batch_1", "wb") as f:
        pickle.dump([1, 2, 3], f)
    with pytest.raises(DatasetError, match="expected a dict"):
        load_dataset("cifar10", path=str(tmp_path))


# --------------------------------------------------------------------------------------------------- hf:


def test_hf_without_flwr_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)  # import now raises ImportError
    with pytest.raises(ImportError, match="flwr-datasets"):
        load_dataset("hf:uoft-cs/cifar10")


def _fake_flwr_datasets(monkeypatch, federated_dataset):
    mod = types.ModuleType("flwr_datasets")
    mod.FederatedDataset = federated_dataset
    monkeypatch.setitem(sys.modules, "flwr_datasets", mod)


def test_hf_hub_unreachable(monkeypatch):
    class Offline:
        def __init__(self, **kwargs):
            pass

        def load_split(self, split):
            raise ConnectionError("Failed to resolve 'huggingface.co'")

    _fake_flwr_datasets(monkeypatch, Offline)
    with pytest.raises(DatasetError, match="could not load 'hf:mnist'.*huggingface.co"):
        load_dataset("hf:mnist")


def _fake_hub(monkeypatch, label_column="label"):
    class Table:
        def __init__(self, n, seed):
            rng = np.random.default_rng(seed)
            self.cols = {
                "img": [rng.integers(0, 256, (6, 5, 3), dtype=np.uint8) for _ in range(n)],
                label_column: [i % 4 for i in range(n)],
            }
            self.column_names = list(self.cols)

        def __getitem__(self, key):
            return self.cols[key]

    class Fds:
        def __init__(self, dataset, partitioners):
            assert dataset == "someone/tiny" and partitioners == {"train": 1}

        def load_split(self, split):
            return Table(8 if split == "train" else 4, seed=len(split))

    _fake_flwr_datasets(monkeypatch, Fds)


def test_hf_conversion_with_fake_hub(monkeypatch):
    _fake_hub(monkeypatch)
    train, test = load_dataset("hf:someone/tiny")
    assert train.x.shape == (8, 3, 6, 5) and test.x.shape == (4, 3, 6, 5)  # channels-last → (N, C, H, W)
    assert train.num_classes == 4 and train.name == "hf:someone/tiny"
    raw, _ = load_dataset("hf", dataset="someone/tiny", normalize=False)
    assert 0 <= raw.x.min() and raw.x.max() <= 1


def test_hf_unknown_columns(monkeypatch):
    _fake_hub(monkeypatch, label_column="target")
    with pytest.raises(DatasetError, match="no label column"):
        load_dataset("hf:someone/tiny")
    assert len(load_dataset("hf:someone/tiny", label_key="target")[0]) == 8


def test_hf_needs_a_name():
    with pytest.raises(ConfigError, match="name the dataset"):
        load_dataset("hf:")


@pytest.mark.parametrize("name", ["/etc", "./data", "../x", "~/x", "a/b/c", "a/../b", "someone/..", "C:/x", " x",
                                  "x\ny"])
def test_hf_refuses_a_local_path(monkeypatch, name):
    """A node that allows ``hf`` allows the hub: a run config's ``hf:<path>`` would have flwr-datasets read the
    node's own files (``load_dataset`` takes a folder too); refused before flwr-datasets is touched."""
    _fake_hub(monkeypatch)
    with pytest.raises(ConfigError, match="not a Hugging Face hub id"):
        load_dataset(f"hf:{name}")
    assert load_dataset("hf:someone/tiny")[0].name == "hf:someone/tiny"  # a hub id still loads


@pytest.mark.parametrize("name", ["data", "someone/tiny", "evil.py"])
def test_hf_refuses_a_name_the_nodes_working_folder_holds(monkeypatch, tmp_path, name):
    """``load_dataset`` reads a local folder (or script) of the name first: ``hf:data`` or ``hf:someone/tiny`` with
    such a folder where the ClientApp runs would read the node's files."""
    _fake_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).mkdir()
    with pytest.raises(ConfigError, match="working folder holds a file or folder of that name|not a Hugging Face"):
        load_dataset(f"hf:{name}")


# ------------------------------------------------------------------------------------------- partitions


def _assert_exact_cover(parts, n):
    assert all(p.dtype == np.int64 for p in parts)
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert np.array_equal(np.sort(allidx), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), k=st.integers(1, 20), seed=st.integers(0, 2**31))
def test_iid_exact_cover_balanced_deterministic(n, k, seed):
    if k > n:
        with pytest.raises(ValueError):
            partition_iid(n, k, seed)
        return
    parts = partition_iid(n, k, seed)
    assert len(parts) == k
    _assert_exact_cover(parts, n)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition_iid(n, k, seed), strict=True))


def test_iid_seed_changes_assignment():
    a, b = partition_iid(100, 4, seed=0), partition_iid(100, 4, seed=1)
    assert not all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@settings(max_examples=40, deadline=None)
@given(
    labels=st.lists(st.integers(0, 5), min_size=20, max_size=300),
    k=st.integers(1, 8),
    alpha=st.sampled_from([0.05, 0.3, 1.0, 100.0]),
    seed=st.integers(0, 1000),
    min_size=st.integers(0, 2),
)
def test_dirichlet_exact_cover_min_size_deterministic(labels, k, alpha, seed, min_size):
    y = np.array(labels)
    try:
        parts = partition_dirichlet(y, k, alpha, seed=seed, min_size=min_size)
    except ValueError as exc:  # allowed only as the documented "no draw in max_tries" failure
        assert "tries" in str(exc)
        return
    assert len(parts) == k
    _assert_exact_cover(parts, len(y))
    assert min(len(p) for p in parts) >= min_size
    again = partition_dirichlet(torch.as_tensor(y), k, alpha, seed=seed, min_size=min_size)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def _label_skew(labels, parts, num_classes=10):
    """Mean total-variation distance between each part's label distribution and the global one."""
    glob = np.bincount(labels, minlength=num_classes) / len(labels)
    tv = [0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / len(p) - glob).sum() for p in parts]
    return float(np.mean(tv))


def test_dirichlet_small_alpha_is_skewed(digits):
    y = digits[0].y.numpy()
    skewed = partition_dirichlet(y, 10, alpha=0.1, seed=0, min_size=10)
    near_iid = partition_dirichlet(y, 10, alpha=1000.0, seed=0, min_size=10)
    iid = partition_iid(len(y), 10, seed=0)
    assert min(len(p) for p in skewed) >= 10
    assert _label_skew(y, skewed) > 0.5
    assert _label_skew(y, near_iid) < 0.1
    assert _label_skew(y, iid) < 0.1
    # small alpha: most parts are dominated by a few classes
    top2 = [np.sort(np.bincount(y[p], minlength=10))[-2:].sum() / len(p) for p in skewed]
    assert np.median(top2) > 0.7


def test_dirichlet_min_size_enforced_and_errors():
    y = np.repeat(np.arange(10), 20)
    parts = partition_dirichlet(y, 10, alpha=0.5, seed=3, min_size=8)
    assert min(len(p) for p in parts) >= 8
    with pytest.raises(ValueError, match="exceeds"):
        partition_dirichlet(y, 10, alpha=0.5, min_size=21)
    with pytest.raises(ValueError, match="tries"):
        partition_dirichlet(y, 10, alpha=0.01, min_size=19, max_tries=3)
    with pytest.raises(ValueError, match="alpha"):
        partition_dirichlet(y, 10, alpha=0.0)


def test_partitioner_registry_matches_functions(digits):
    y = digits[0].y.numpy()
    viareg = PARTITIONERS.build("dirichlet", alpha=0.3, seed=2, min_size=5)(y, 7)
    direct = partition_dirichlet(y, 7, 0.3, seed=2, min_size=5)
    assert all(np.array_equal(a, b) for a, b in zip(viareg, direct, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(partition("iid", y, 3, seed=4), partition_iid(len(y), 3, 4),
                                                       strict=True))
    with pytest.raises(ConfigError):
        PARTITIONERS.build("iid", alpha=0.3)


# ---------------------------------------------------------------------------------------------- batches


def test_batches_cover_epoch_and_reproducible():
    x = torch.arange(23, dtype=torch.float32).reshape(23, 1, 1, 1)
    y = torch.arange(23)
    got = list(batches(x, y, 5, seed=0))
    assert [len(b[1]) for b in got] == [5, 5, 5, 5, 3]
    seen = torch.cat([b[1] for b in got])
    assert sorted(seen.tolist()) == list(range(23)) and seen.tolist() != list(range(23))
    assert all(torch.equal(xb.reshape(-1).long(), yb) for xb, yb in got)  # x and y stay paired
    assert torch.equal(seen, torch.cat([b[1] for b in batches(x, y, 5, seed=0)]))
    gen = torch.Generator().manual_seed(0)
    e1 = torch.cat([b[1] for b in batches(x, y, 5, generator=gen)])
    e2 = torch.cat([b[1] for b in batches(x, y, 5, generator=gen)])
    assert torch.equal(e1, seen) and not torch.equal(e1, e2)
    assert [len(b[1]) for b in batches(x, y, 5, seed=0, drop_last=True)] == [5, 5, 5, 5]
    assert torch.equal(torch.cat([b[1] for b in batches(x, y, 5, shuffle=False)]), y)
    with pytest.raises(ValueError):
        next(batches(x, y[:-1], 5))
    with pytest.raises(ValueError):
        next(batches(x, y, 0))


# ---------------------------------------------------------------------------------------------- mnist1d


@pytest.fixture(scope="module")
def mnist1d():
    return load_dataset("mnist1d", num_samples=4000)


def _no_network(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_mnist1d_generated_offline_without_files(monkeypatch, tmp_path):
    _no_network(monkeypatch)
    monkeypatch.chdir(tmp_path)  # the package's cached-download path would write ./mnist1d_data.pkl here
    train, test = load_dataset("mnist1d", num_samples=400, seed=3)
    assert (len(train), len(test)) == (320, 80)
    assert list(tmp_path.iterdir()) == []


def test_mnist1d_shapes_classes_and_normalisation(mnist1d):
    train, test = mnist1d
    assert (len(train), len(test)) == (3200, 800)
    for s in (train, test):
        assert s.x.dtype == torch.float32 and s.y.dtype == torch.int64
        assert s.x.shape[1:] == (1, 1, 40) and s.in_shape == (1, 1, 40)
        assert s.num_classes == 10 and s.name == "mnist1d"
        assert set(s.y.tolist()) == set(range(10))
    counts = np.bincount(np.concatenate([train.y.numpy(), test.y.numpy()]), minlength=10)
    assert counts.tolist() == [400] * 10  # the generator makes the same count per class
    assert abs(train.x.mean().item()) < 1e-4 and abs(train.x.std().item() - 1.0) < 1e-3
    assert len({tuple(r) for r in train.x[:, 0, 0, :].numpy().round(4).tolist()}) == len(train)  # no repeats


def test_mnist1d_deterministic_from_the_seed(mnist1d):
    again = load_dataset("mnist1d", num_samples=4000)
    for a, b in zip(mnist1d, again, strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    other, _ = load_dataset("mnist1d", num_samples=4000, seed=1)
    assert not torch.equal(other.x, mnist1d[0].x)


def test_mnist1d_leaves_the_global_rngs_alone():
    import random

    np.random.seed(123)
    random.seed(123)
    expected = (np.random.rand(), random.random())
    np.random.seed(123)
    random.seed(123)
    load_dataset("mnist1d", num_samples=100, seed=7)
    assert (np.random.rand(), random.random()) == expected


def test_mnist1d_options():
    train, test = load_dataset("mnist1d", num_samples="200", length=64, test_fraction=0.5, normalize=False)
    assert train.x.shape == (100, 1, 1, 64) and test.x.shape == (100, 1, 1, 64)
    assert abs(train.x.std().item() - 1.0) > 1e-3  # the generator's own scaling: over train and test together
    for bad in ({"num_samples": 10}, {"num_samples": 4000.5}, {"length": 2}, {"test_fraction": 1.0}):
        with pytest.raises(ConfigError):
            load_dataset("mnist1d", **bad)
