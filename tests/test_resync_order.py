"""A reply's ``pending`` list (the client's resync request) is as old as the reply. With queued tasks (prefetch) a
node's replies may be read out of order: an older reply read after a newer one must not make the server nack, as
"lost: unknown to the server", a task whose ack the node has received since (the newer reply no longer lists it).
The nack did no harm to the model (the client ignores a resolution for a task it no longer holds) but counted a
lost task and a task never sent (``unknown_tasks``), so ``fedcomp check`` counted more tasks than were sent.
What the resync is for (a pending task a restarted server holds nothing about) is tested in
tests/test_client_restart.py."""

from __future__ import annotations

import torch

from fedcomp.client.acks import ClientSide
from fedcomp.client.pipeline import build
from fedcomp.protocol import Outcome, ProtocolConfig, ReplyMeta
from fedcomp.server import ServerProtocol
from fedcomp.server.optimizers import SERVER_OPTIMIZERS
from fedcomp.server.staleness import STALENESS
from fedcomp.spec import ModelSpec

SPEC = ModelSpec((("w", (12, 5)), ("b", (5,))))
NODE = 4


def make_proto() -> ServerProtocol:
    params = {n: torch.zeros(s) for n, s in SPEC.entries}
    opt = SERVER_OPTIMIZERS.build("sgd", lr=1.0)
    config = ProtocolConfig(buffer_size=1, max_staleness=5, prefetch=1)
    return ServerProtocol(SPEC, params, opt, STALENESS.build("constant"), config)


def run(side: ClientSide, task) -> tuple[bytes, ReplyMeta]:
    """The node runs ``task``: takes its resolutions, sends an update and lists what is still pending."""
    side.apply(task.resolutions)
    blob = side.pipeline.send({n: torch.ones(s) for n, s in SPEC.entries}, base_version=task.base_version,
                              client_id=NODE)
    side.sent(task.task_id, side.pipeline.last_seq)
    pending = tuple(t for t in side.pending_tasks() if t != task.task_id)
    return blob, ReplyMeta(task.task_id, side.pipeline.last_seq, 1, 9, pending=pending)


def test_an_overtaken_reply_does_not_nack_a_task_acked_since():
    p = make_proto()
    side = ClientSide(build("int8", SPEC, memory="residual"))
    a, x = p.dispatch(NODE, 0.0), p.dispatch(NODE, 0.0)  # x queued behind a
    reply_a = run(side, a)
    assert p.on_reply(NODE, *reply_a, now=1.0).outcome is Outcome.APPLIED
    b = p.dispatch(NODE, 1.0)  # queued behind x, carrying a's ack
    assert [r.task_id for r in b.resolutions] == [a.task_id]
    reply_x = run(side, x)  # a's ack is on b, not seen yet: x's reply lists a as pending
    assert reply_x[1].pending == (a.task_id,)
    reply_b = run(side, b)  # now it is
    assert reply_b[1].pending == (x.task_id,)
    assert p.on_reply(NODE, *reply_b, now=2.0).outcome is Outcome.APPLIED  # read first
    assert p.on_reply(NODE, *reply_x, now=2.1).outcome is Outcome.APPLIED  # overtaken
    assert p.stats.lost == 0 and p.stats.unknown_tasks == 0
    nxt = p.dispatch(NODE, 3.0)
    assert sorted((r.task_id, r.outcome) for r in nxt.resolutions) == [(x.task_id, Outcome.APPLIED),
                                                                       (b.task_id, Outcome.APPLIED)]
    side.apply(nxt.resolutions)
    assert not side.pipeline.pending

