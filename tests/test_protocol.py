"""The update protocol without Flower: staleness bound, weights, dedup, ack/nack, O(nnz) path, loops, checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from fedcomp.client.acks import ClientSide
from fedcomp.client.pipeline import build
from fedcomp.payload import TensorPayload, Update, Values
from fedcomp.protocol import SYNC_RULES, Outcome, ProtocolConfig, ReplyMeta, Resolution
from fedcomp.server import ClientSelection, ServerProtocol
from fedcomp.server.loops import (
    LOOPS,
    FailureEvent,
    LoopConfig,
    ReplyEvent,
    Reporter,
    SendReceipt,
    Transport,
    encode_model,
)
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.spec import ModelSpec
from fedcomp.wire import decode, encode

SPEC = ModelSpec((("w", (30, 20)), ("b", (20,))))


def make_proto(**cfg) -> ServerProtocol:
    params = {n: torch.zeros(s) for n, s in SPEC.entries}
    staleness = STALENESS.build(cfg.pop("staleness", "constant"), **cfg.pop("staleness_opts", {}))
    opt = SERVER_OPTIMIZERS.build("sgd", lr=1.0)
    return ServerProtocol(SPEC, params, opt, staleness, ProtocolConfig(**cfg))


def sparse_update(client: int, seq: int, base: int, value: float = 1.0, idx=(3, 17, 200)) -> Update:
    indices = torch.tensor(sorted(idx), dtype=torch.int64)
    return Update(
        {
            "w": TensorPayload((30, 20), Values.f32(torch.full((len(idx),), value)), indices),
            "b": TensorPayload((20,), Values.f32(torch.full((20,), value))),
        },
        base_version=base,
        seq=seq,
        client_id=client,
    )


def reply(proto: ServerProtocol, client: int, task, seq: int, value: float = 1.0, examples: int = 1, inc: int = 7):
    blob = encode(sparse_update(client, seq, task.base_version, value), SPEC)
    return proto.on_reply(client, blob, ReplyMeta(task.task_id, seq, examples, inc), now=1.0)


def test_applied_at_most_once_and_duplicates_counted():
    p = make_proto(buffer_size=1)
    t = p.dispatch(5, now=0.0)
    d = reply(p, 5, t, seq=1, value=2.0)
    assert d.outcome is Outcome.APPLIED and d.stepped and p.version == 1
    again = reply(p, 5, t, seq=1, value=2.0)
    assert again.outcome is Outcome.DUPLICATE and p.version == 1
    assert p.stats.duplicate == 1 and p.stats.accepted == 1
    # params -= 1.0 * update (sgd lr 1, normalize count, K=1)
    assert torch.allclose(p.params["b"], torch.full((20,), -2.0))
    assert p.params["w"].reshape(-1)[17] == -2.0 and p.params["w"].reshape(-1)[0] == 0.0
    nxt = p.dispatch(5, now=2.0)
    assert [(r.seq, r.outcome) for r in nxt.resolutions] == [(1, Outcome.APPLIED)]


def test_staleness_bound_and_weights():
    p = make_proto(buffer_size=1, max_staleness=2, staleness="polynomial", staleness_opts={"a": 1.0})
    tasks = {c: p.dispatch(c, now=0.0) for c in range(1, 6)}  # all at base version 0
    w = STALENESS.build("polynomial", a=1.0)
    for i, c in enumerate(range(1, 6)):
        d = reply(p, c, tasks[c], seq=1)
        if i <= 2:  # tau = 0, 1, 2 are within the bound
            assert d.outcome is Outcome.APPLIED and d.staleness == i
            assert d.weight == pytest.approx(w(i))
        else:
            assert d.outcome is Outcome.STALE and "staleness 3 > 2" in d.reason
    assert p.version == 3
    assert p.stats.staleness_hist == {0: 1, 1: 1, 2: 1} and p.stats.stale == 2
    nack = p.dispatch(4, now=1.0).resolutions
    assert nack[0].outcome is Outcome.STALE and nack[0].seq == 1
    # K=1, normalize "count": each step moves b by -w(tau)
    assert p.params["b"][0].item() == pytest.approx(-(w(0) + w(1) + w(2)))


def test_sync_weights_by_examples():
    p = make_proto(buffer_size=0, weight_by_examples=True, normalize="weights", max_staleness=0)
    ta, tb = p.dispatch(1, 0.0), p.dispatch(2, 0.0)
    reply(p, 1, ta, seq=1, value=1.0, examples=30)
    reply(p, 2, tb, seq=1, value=4.0, examples=10)
    assert p.version == 0  # sync: the caller closes the round
    p.close_round(now=2.0)
    assert p.version == 1
    assert p.params["b"][0].item() == pytest.approx(-(30 * 1.0 + 10 * 4.0) / 40)


def test_late_reply_after_timeout_is_never_applied_and_client_gets_nack():
    p = make_proto(buffer_size=1, task_timeout=10.0)
    t = p.dispatch(3, now=0.0)
    assert p.expire(now=11.0) == [t]
    d = reply(p, 3, t, seq=1)
    assert d.outcome is Outcome.LATE and p.version == 0 and p.stats.timeout == 1 and p.stats.late == 1
    assert not p.available(3, now=12.0)  # backing off after a failure
    nxt = p.dispatch(3, now=100.0)
    r = nxt.resolutions[0]
    assert (r.task_id, r.seq, r.outcome) == (t.task_id, 0, Outcome.TIMEOUT)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda blob, u: b"garbage" + blob, "wire"),
        (lambda blob, u: blob[:-3], "wire"),
        (lambda blob, u: encode(_with(u, base=9), SPEC), "base version"),
        (lambda blob, u: encode(_with(u, client=99), SPEC), "client id"),
        (lambda blob, u: encode(_with(u, seq=5), SPEC), "seq"),
        (lambda blob, u: encode(_renamed(u, "c"), ModelSpec((("w", (30, 20)), ("c", (20,))))), "wire"),
    ],
)
def test_bad_replies_are_rejected_with_a_reason_and_nacked(mutate, reason):
    p = make_proto(buffer_size=1)
    t = p.dispatch(4, now=0.0)
    u = sparse_update(4, 1, t.base_version)
    d = p.on_reply(4, mutate(encode(u, SPEC), u), ReplyMeta(t.task_id, 1, 1, 1), now=1.0)
    assert d.outcome is Outcome.REJECTED and d.reason.startswith(reason), d.reason
    assert p.version == 0 and p.stats.rejected == 1
    assert sum(p.stats.reject_reasons.values()) == 1
    r = p.dispatch(4, now=2.0).resolutions[0]
    assert r.outcome is Outcome.REJECTED and r.seq == 1


def test_non_finite_values_are_rejected_even_if_the_codec_let_them_through(monkeypatch):
    import fedcomp.server.checks as protocol

    p = make_proto(buffer_size=1)
    t = p.dispatch(4, now=0.0)
    bad = _with(sparse_update(4, 1, 0), value=float("nan"))
    monkeypatch.setattr(protocol, "decode", lambda blob, spec, max_bytes=None: bad)
    d = p.on_reply(4, b"whatever", ReplyMeta(t.task_id, 1, 1, 1), now=1.0)
    assert d.outcome is Outcome.REJECTED and d.reason.startswith("non-finite")


def _renamed(u: Update, name: str) -> Update:
    """Same values for a model whose second tensor has another name (another fingerprint)."""
    return Update({"w": u.tensors["w"], name: u.tensors["b"]}, u.base_version, u.seq, u.client_id)


def _with(u: Update, value=None, base=None, client=None, seq=None) -> Update:
    tensors = dict(u.tensors)
    if value is not None:
        tensors["b"] = TensorPayload((20,), Values.f32(torch.full((20,), value)))
    return Update(
        tensors,
        base_version=u.base_version if base is None else base,
        seq=u.seq if seq is None else seq,
        client_id=u.client_id if client is None else client,
    )


def test_unknown_client_and_failure_events():
    p = make_proto(buffer_size=1)
    d = p.on_reply(42, b"x", ReplyMeta(1, 1), now=0.0)
    assert d.outcome is Outcome.REJECTED and "unknown client" in d.reason
    t = p.dispatch(1, now=0.0)
    assert p.fail_task(1, t.task_id, Outcome.LOST, "NODE_UNAVAILABLE", now=1.0)
    assert not p.fail_task(1, t.task_id, Outcome.LOST, "again", now=1.0)
    assert p.stats.lost == 1
    assert p.dispatch(1, now=60.0).resolutions[0].outcome is Outcome.LOST


def test_sparse_path_never_densifies(monkeypatch):
    """Aggregation is O(nnz): a sparse payload is scatter-added, never turned into a dense tensor."""

    def boom(self):
        raise AssertionError("densified a client payload")

    monkeypatch.setattr(TensorPayload, "to_dense", boom)
    p = make_proto(buffer_size=2)
    for c in (1, 2):
        reply(p, c, p.dispatch(c, 0.0), seq=1)
    assert p.version == 1


def test_conservation_over_random_losses():
    """Σ applied + Σ residuals + Σ pending = Σ computed, with acks/nacks flowing through tasks."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    p = make_proto(buffer_size=1, max_staleness=100, normalize="sum", backoff=0.0)
    clients = {c: ClientSide(build("int8", SPEC, memory="residual")) for c in (1, 2, 3)}
    computed = {n: torch.zeros(s) for n, s in SPEC.entries}
    now = 0.0
    for _ in range(60):
        c = rng.choice(list(clients))
        side = clients[c]
        if p.busy(c):
            continue
        now += 1.0
        task = p.dispatch(c, now)
        side.apply(task.resolutions)
        delta = {n: torch.randn(s, generator=gen) for n, s in SPEC.entries}
        for n in computed:
            computed[n] += delta[n]
        blob = side.pipeline.send(delta, base_version=task.base_version, client_id=c)
        side.sent(task.task_id, side.pipeline.last_seq)
        fate = rng.random()
        if fate < 0.6:
            p.on_reply(c, blob, ReplyMeta(task.task_id, side.pipeline.last_seq, 1, c), now)
            if fate < 0.1:  # delivered twice
                p.on_reply(c, blob, ReplyMeta(task.task_id, side.pipeline.last_seq, 1, c), now)
        elif fate < 0.8:
            p.fail_task(c, task.task_id, Outcome.LOST, "node unavailable", now)
        else:
            p.expire(now + 1e9)
            p.on_reply(c, blob, ReplyMeta(task.task_id, side.pipeline.last_seq, 1, c), now)  # late
    for c, side in clients.items():  # final tasks deliver the last resolutions
        p.expire(now + 1e9)
        side.apply(p.dispatch(c, now + 2e9).resolutions)
    assert p.stats.duplicate > 0 and p.stats.late > 0 and p.stats.lost > 0
    for n in computed:
        held = sum(side.pipeline.memory.residual(n) for side in clients.values())
        updates = [u for side in clients.values() for u in side.pipeline.pending.values()]
        pending = sum(u.tensors[n].to_dense() for u in updates)
        applied = -p.params[n]
        assert torch.allclose(applied + held + pending, computed[n], atol=1e-4)
        assert all(not side.pipeline.pending for side in clients.values())


@pytest.mark.parametrize("outcome", [Outcome.LOST, Outcome.APPLIED])
def test_a_resolution_of_another_seq_leaves_the_update_pending(outcome):
    """An ack or nack naming the right task but another seq changes nothing: the update stays pending and in the
    resync request, and the resolution with its own seq then applies (it used to be dropped from ``task_seqs``
    first: never restored, never listed again)."""
    side = ClientSide(build("int8", SPEC, memory="residual"))
    delta = {n: torch.ones(s) for n, s in SPEC.entries}
    side.send(7, delta)
    assert side.apply([Resolution(7, 99, outcome)]) == {}
    assert side.task_seqs == {7: 1} and 1 in side.pipeline.pending and side.pending_tasks() == (7,)
    assert side.apply([Resolution(7, 1, outcome)]) == {outcome.value: 1}
    assert side.task_seqs == {} and side.pipeline.pending == {} and side.pending_tasks() == ()
    restored = side.pipeline.memory.residual("w")
    assert torch.allclose(restored, torch.ones(30, 20) if outcome is Outcome.LOST else torch.zeros(30, 20), atol=0.01)


@pytest.mark.parametrize("outcome", [Outcome.LOST, Outcome.APPLIED])
def test_copies_of_a_resolution_and_ones_for_tasks_never_held_change_nothing(outcome):
    """The server copies a queued resolution to a node that lists its task id (``Ledger.resync_pending``), so a
    client may hear one twice, or hear of tasks it never held: a nack restores its update into the residual once,
    an ack drops it once, and the rest leaves the residual, the pending updates and the task map as they were."""
    side = ClientSide(build("int8", SPEC, memory="residual"))
    side.send(7, {n: torch.ones(s) for n, s in SPEC.entries})
    assert side.apply([Resolution(7, 1, outcome), Resolution(7, 1, outcome)]) == {outcome.value: 1}
    after = side.pipeline.memory.residual("w").clone()
    assert side.apply([Resolution(7, 1, outcome), Resolution(8, 1, Outcome.LOST), Resolution(9, 2, outcome)]) == {}
    assert torch.equal(side.pipeline.memory.residual("w"), after)
    assert side.task_seqs == {} and side.pipeline.pending == {} and side.pending_tasks() == ()
    want = torch.ones(30, 20) if outcome is Outcome.LOST else torch.zeros(30, 20)
    assert torch.allclose(after, want, atol=0.01)  # restored once, not twice


def test_checkpoint_roundtrip_turns_open_tasks_into_nacks(tmp_path):
    p = make_proto(buffer_size=1)
    reply(p, 1, p.dispatch(1, 0.0), seq=1)
    open_task = p.dispatch(2, 0.0)
    p.dispatch(1, 0.0)
    state = p.state_dict()
    path = tmp_path / "ck.pt"
    torch.save(state, path)
    q = make_proto(buffer_size=1)
    q.load_state_dict(torch.load(path, weights_only=True))
    assert q.version == 1 and torch.equal(q.params["b"], p.params["b"]) and not q.tasks
    assert q.next_task_id == p.next_task_id
    # the saved counters hold everything up to the checkpoint, the two open tasks counted lost (a resume nacks them)
    assert (q.totals.accepted, q.totals.lost) == (p.totals.accepted + p.stats.accepted, 2) == (1, 2)
    r = q.dispatch(2, 0.0).resolutions
    assert (r[-1].task_id, r[-1].outcome) == (open_task.task_id, Outcome.LOST)
    assert [r.outcome for r in q.dispatch(1, 0.0).resolutions] == [Outcome.APPLIED, Outcome.LOST]


def test_selection_over_selects_and_targets():
    s = ClientSelection(fraction=0.5, min_clients=2, over_selection=0.5)
    chosen, target = s.choose(list(range(10)), random.Random(0))
    assert target == 5 and len(chosen) == 8 and len(set(chosen)) == 8
    assert ClientSelection(min_clients=3).choose([1, 2], random.Random(0)) == ([1, 2], 2)


class FakeTransport(Transport):
    """Clients answer after ``delay[c]`` ticks of a virtual clock; ``drop`` never answer; ``fail`` error out."""

    def __init__(self, delays: dict[int, float], drop=(), fail=()):
        self.delays, self.drop, self.fail = delays, set(drop), set(fail)
        self.t = 0.0
        self.queue: list[tuple[float, object]] = []
        self.pipes = {c: ClientSide(build("int8", SPEC, memory="residual")) for c in delays}
        self.delivered = []

    def now(self) -> float:
        return self.t

    def clients(self):
        return sorted(self.delays)

    def send(self, task, model):
        side = self.pipes[task.client]
        side.apply(task.resolutions)
        self.delivered += task.resolutions
        assert decode(model, SPEC).base_version == task.base_version
        if task.client in self.drop:
            return SendReceipt(len(model) + 100, 6)
        if task.client in self.fail:
            ev = FailureEvent(task.task_id, task.client, Outcome.LOST, "CLIENT_APP_RAISED_EXCEPTION")
        else:
            delta = {n: torch.full(s, 0.01) for n, s in SPEC.entries}
            blob = side.pipeline.send(delta, base_version=task.base_version, client_id=task.client)
            side.sent(task.task_id, side.pipeline.last_seq)
            ev = ReplyEvent(task.task_id, task.client, blob, ReplyMeta(task.task_id, side.pipeline.last_seq, 10, 1))
        self.queue.append((self.t + self.delays[task.client], ev))
        return SendReceipt(len(model) + 100, 6)

    def poll(self, wait):
        self.queue.sort(key=lambda e: e[0])
        if self.queue and self.queue[0][0] <= self.t + wait:
            self.t = max(self.t, self.queue[0][0])
            due = [e for t, e in self.queue if t <= self.t]
            self.queue = [(t, e) for t, e in self.queue if t > self.t]
            return due
        self.t += wait
        return []


def run_loop(mode, transport, tmp_path, task_timeout=50.0, **kw):
    cfg = {"async": dict(buffer_size=2, max_staleness=3), "sync": dict(weight_by_examples=True, normalize="weights")}
    p = make_proto(task_timeout=task_timeout, backoff=1.0, **cfg[mode])
    loop_cfg = LoopConfig(poll_interval=5.0, round_timeout=30.0, **kw)
    reporter = Reporter(tmp_path, evaluate=lambda params: {"accuracy": 0.5}, checkpoint_every=2, clock=transport)
    loop = LOOPS.get(mode)(p, transport, loop_cfg, reporter, clock=transport)
    loop.run()
    return p, reporter


def test_async_loop_with_a_dead_and_a_failing_client(tmp_path):
    tr = FakeTransport({1: 1.0, 2: 2.5, 3: 1.0, 4: 1.0}, drop={3}, fail={4})
    p, rep = run_loop("async", tr, tmp_path, task_timeout=4.0, num_versions=6, concurrency=3)
    assert p.version == 6
    totals = p.totals
    assert totals.timeout >= 1 and totals.lost >= 1 and totals.accepted == 12
    assert max(int(k) for r in rep.rows for k in r["staleness_hist"]) <= 3
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and (tmp_path / "checkpoint.pt").exists()
    assert rep.rows[-1]["accuracy"] == 0.5 and rep.rows[0]["payload_bytes_down"] > 0


def test_sync_loop_closes_rounds_at_the_deadline(tmp_path):
    tr = FakeTransport({1: 1.0, 2: 1.0, 3: 100.0})  # client 3 always misses the 30 s deadline
    p, rep = run_loop("sync", tr, tmp_path, num_versions=3, selection=ClientSelection(fraction=1.0))
    assert p.version == 3
    assert all(r["accepted"] == 2 for r in rep.rows)
    assert p.totals.timeout >= 1
    assert p.params["b"][0].item() == pytest.approx(-0.03, rel=0.05)  # int8 quantized 0.01 per round


def test_encode_model_is_dense_fp32_at_the_version():
    params = {n: torch.randn(s) for n, s in SPEC.entries}
    u = decode(encode_model(params, SPEC, 7), SPEC)
    assert u.base_version == 7 and u.seq == 0
    assert all(torch.equal(u.tensors[n].to_dense(), params[n]) for n in params)


def test_checkpoint_resume_continues_the_run(tmp_path):
    tr = FakeTransport({1: 1.0, 2: 1.5})
    p, rep = run_loop("async", tr, tmp_path, num_versions=4)
    assert p.version == 4 and (tmp_path / "checkpoint.pt").exists()
    q = make_proto(task_timeout=50.0, backoff=1.0, buffer_size=2, max_staleness=3)
    Reporter.load_checkpoint(tmp_path / "checkpoint.pt", q)
    assert q.version == 4 and torch.equal(q.params["w"], p.params["w"])
    rep2 = Reporter(tmp_path / "resumed", clock=tr)
    LOOPS.get("async")(q, tr, LoopConfig(num_versions=7, poll_interval=5.0), rep2, clock=tr).run()
    assert q.version == 7 and [r["version"] for r in rep2.rows] == [5, 6, 7]
    # updates in flight at the checkpoint came back to their clients as "lost: server restarted" nacks
    assert any(r.outcome is Outcome.LOST and "server restarted" in r.reason for r in tr.delivered)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_loop_gives_up_when_every_task_fails(mode, tmp_path):
    tr = FakeTransport({1: 1.0, 2: 1.0}, fail={1, 2})
    p = make_proto(buffer_size=1, backoff=0.0)
    loop = LOOPS.get(mode)(p, tr, LoopConfig(num_versions=3, max_failures=6), Reporter(None, clock=tr), clock=tr)
    loop.run()
    assert p.version == 0 and "6 failed tasks in a row" in loop.stopped_reason
    assert "CLIENT_APP_RAISED_EXCEPTION" in loop.stopped_reason


def test_sync_rules_override_the_async_options_and_async_takes_them_as_given():
    async_options = dict(buffer_size=3, max_staleness=7, normalize="sum", prefetch=2, balance=2.0, task_timeout=9.0)
    sync = ProtocolConfig.of_mode("sync", **async_options)
    assert {k: getattr(sync, k) for k in SYNC_RULES} == SYNC_RULES
    assert sync.task_timeout == 9.0  # what sync rounds do not fix passes through
    mode_async = ProtocolConfig.of_mode("async", **async_options)
    assert {k: getattr(mode_async, k) for k in async_options} == async_options
    assert not mode_async.weight_by_examples


def test_a_failing_node_is_backed_off_exponentially_up_to_16_times_and_a_good_reply_resets_it():
    """Each failed task in a row doubles the node's pause (``backoff`` x 1, 2, 4, 8, 16, then 16); the node is not
    available before it ends and is after; a good reply starts the count again."""
    p = make_proto(buffer_size=1, backoff=1.0)
    now, waits = 0.0, []
    for _ in range(6):
        task = p.dispatch(1, now)
        assert p.fail_task(1, task.task_id, Outcome.LOST, "node gone", now)
        waits.append(p.ledger(1).unavailable_until - now)
        assert not p.available(1, now + waits[-1] - 0.01) and p.available(1, now + waits[-1])
        now += waits[-1]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0]
    task = p.dispatch(1, now)
    assert p.on_reply(1, encode(sparse_update(1, 1, task.base_version), SPEC),
                      ReplyMeta(task.task_id, 1), now).outcome is Outcome.APPLIED
    task = p.dispatch(1, now)
    assert p.fail_task(1, task.task_id, Outcome.LOST, "node gone", now)
    assert p.ledger(1).unavailable_until - now == 1.0  # the count started again
