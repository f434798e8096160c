"""A saved client session whose bytes are whole but whose contents lie is refused when it is read: a
``ConfigError`` naming what is wrong (``CheckInputError`` in ``fedcomp check``), never a state that loads and then
fails at a nack or a send, never another exception type."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp import tensortree
from fedcomp.flower.session import ClientSession, OtherRun
from fedcomp.protocol import Outcome, Resolution
from fedcomp.registry import ConfigError
from fedcomp.spec import ModelSpec
from fedcomp.task.config import Compression
from fedcomp.tools.check import CheckInputError, check_client

SHAPES = {"w": (16, 24), "b": (24,)}
SPEC = ModelSpec.from_tensors({n: torch.zeros(s) for n, s in SHAPES.items()})
COMPRESSIONS = {
    "topk+int8": Compression("topk+int8", "residual", "density=0.2"),
    "dgc": Compression("dgc", "dgc", "density=0.2 warmup_epochs=1"),
}
DELETE = object()


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def saved_tree(kind: str) -> dict:
    """The parsed state of a session of ``kind`` with one update sent (task 3, seq 1) and pending."""
    session = ClientSession.fresh(COMPRESSIONS[kind], SPEC, run_key=5)
    session.send(3, grads(0))
    return tensortree.loads(session.to_bytes())


def mutated(tree: dict, path: tuple, value) -> bytes:
    tree = copy.deepcopy(tree)
    node = tree
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return tensortree.dumps(tree)


def load(data: bytes, kind: str) -> ClientSession:
    return ClientSession.from_bytes(data, COMPRESSIONS[kind], SPEC, run_key=5)


W = ("pipeline", "pending", 1, "tensors", "w")
CASES = [
    ("topk+int8", ("incarnation",), float("inf"), "incarnation is not a count"),
    ("topk+int8", ("incarnation",), "abc", "incarnation is not a count"),
    ("topk+int8", ("steps_done",), -1, "steps_done is not a count"),
    ("topk+int8", ("run_key",), 2**64, "run_key is not a count"),
    ("topk+int8", ("task_seqs",), [1], "task_seqs is not a table"),
    ("topk+int8", ("pipeline", "next_seq"), None, "next_seq is not a count"),
    ("topk+int8", ("compression",), "x", "compression is not a table"),
    ("topk+int8", ("pipeline",), [1], "no pipeline table"),
    ("topk+int8", (*W, "shape"), [3, 3], "payload shape"),
    ("topk+int8", (*W, "block"), 0, "block must be"),
    ("topk+int8", (*W, "indices"), torch.arange(77) * 1000, "indices outside"),
    ("topk+int8", (*W, "data"), torch.zeros(5, dtype=torch.int8), "values must be"),
    ("topk+int8", (*W, "scales"), torch.full((1,), math.nan), "NaN or Inf"),
    ("topk+int8", ("pipeline", "pending", 1, "tensors", "zzz"), {}, "KeyError: .shape."),
    ("topk+int8", ("pipeline", "pending", 1, "tensors", "w"), DELETE, "do not match the spec"),
    ("topk+int8", ("pipeline", "pending", 1), b"garbage", "shorter than"),
    ("topk+int8", ("pipeline", "memory", "errors", "w"), torch.zeros(1), "shape \\(1,\\)"),
    ("topk+int8", ("pipeline", "memory", "errors", "w"), torch.zeros(16, 24, dtype=torch.int64), "floating"),
    ("topk+int8", ("pipeline", "memory", "errors", "w"), torch.full((16, 24), math.inf), "NaN or Inf"),
    ("topk+int8", ("pipeline", "memory", "errors", "zzz"), torch.zeros(3), "no such tensor"),
    ("topk+int8", ("pipeline", "memory", "errors"), 5, "not a table"),
    ("topk+int8", ("pipeline", "totals", "outstanding", "b"), torch.zeros(2, dtype=torch.float64), "running sum"),
    ("topk+int8", ("pipeline", "compressor", "quantizer", "rng"), torch.zeros(3, dtype=torch.uint8), "RuntimeError"),
    ("dgc", ("pipeline", "memory", "v", "w"), torch.zeros(24, 16), "shape \\(24, 16\\)"),
    ("dgc", ("pipeline", "memory", "u", "b"), torch.full((24,), math.nan), "NaN or Inf"),
    ("dgc", ("pipeline", "compressor", "epoch"), math.nan, "epoch"),
]


@pytest.mark.parametrize("kind, path, value, what", CASES, ids=[f"{c[0]}:{'.'.join(map(str, c[1]))}" for c in CASES])
def test_a_state_whose_contents_lie_is_refused_when_read(kind, path, value, what):
    with pytest.raises(ConfigError, match=what):
        load(mutated(saved_tree(kind), path, value), kind)


@pytest.mark.parametrize("kind", sorted(COMPRESSIONS))
def test_a_whole_state_still_loads_and_goes_on(kind):
    """The checks refuse nothing a session writes: loaded, it nacks its pending update and sends again."""
    back = load(tensortree.dumps(saved_tree(kind)), kind)
    assert back.pipeline.pending and back.apply([Resolution(3, 1, Outcome.REJECTED, "test")])
    assert not back.pipeline.pending
    back.send(4, grads(1))
    assert load(back.to_bytes(), kind).pipeline.pending.keys() == {2}


def _leaves(node, path=()):
    """Every (path, value) of a parsed state's tables, the tables themselves too."""
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))


HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.binary(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3), st.just({}), st.just(DELETE),
    st.tuples(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int8, torch.uint8]),
              st.lists(st.integers(0, 30), max_size=2),
              st.sampled_from([0.0, 1.0, math.nan, math.inf, 300.0])).map(
        lambda t: torch.full(t[1], t[2] if t[0].is_floating_point else 1, dtype=t[0])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(COMPRESSIONS)), pick=st.integers(min_value=0), value=HOSTILE)
def test_any_one_value_replaced_is_refused_or_the_session_goes_on(kind, pick, value):
    """Whatever one value of a saved state becomes: a ``ConfigError`` at load (``OtherRun`` where the run key
    changed: a session of another run, passed over), or a session that resolves its pending update, sends and
    saves again, with no other exception on the way."""
    tree = saved_tree(kind)
    paths = [p for p, _ in _leaves(tree) if p]
    data = mutated(tree, paths[pick % len(paths)], value)
    try:
        session = load(data, kind)
    except (ConfigError, OtherRun):
        return
    session.apply([Resolution(3, 1, Outcome.REJECTED, "test")])
    session.send(4, grads(1))
    load(session.to_bytes(), kind)


def test_fedcomp_check_refuses_an_infinite_incarnation_in_one_line(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    (folder / "client-state.pt").write_bytes(mutated(saved_tree("topk+int8"), ("incarnation",), math.inf))
    with pytest.raises(CheckInputError, match="not a fedcomp client state"):
        check_client(folder)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 3000),
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    st.sampled_from([None, math.nan, math.inf, -math.inf]),
    st.data(),
)
def test_the_finite_check_finds_one_nan_or_inf_anywhere_in_any_float_dtype(n, dtype, bad, data):
    """``finite.non_finite`` (one largest-magnitude reduction, the check a saved state's memory and sums get) says
    what ``isfinite(t).all()`` says."""
    from fedcomp.client.finite import non_finite

    t = torch.randn(n).to(dtype)
    if bad is not None and n:
        t[data.draw(st.integers(0, n - 1))] = bad
    finite = non_finite({"t": t}) == []
    assert finite == bool(torch.isfinite(t).all())
    assert finite == (bad is None or n == 0)
