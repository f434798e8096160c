"""``compression_mod``: compressed updates with error feedback for any Flower ``ClientApp``.

One line in the user's app::

    app = ClientApp(mods=[compression_mod])

and ``Compressed(strategy)`` on the server. The user's train function is untouched: it receives an ordinary
dense model ArrayRecord and replies the standard way (the trained weights in the same ArrayRecord key, a
``MetricRecord`` with ``num-examples``). Around it, for a train message that carries fedcomp's ConfigRecord:

1. load the node's ``ClientSession`` from ``context.state`` (built from the compression the server asked for);
2. apply the acks and nacks that came with the task (a nack puts that update back into the residual);
3. give the user's function the dense model (decoding the compressed downlink into the replica if there is one);
4. after it returns, compute the update ``received - trained`` over the float arrays, compress it with error
   feedback into one blob, save the session, and reply with the blob in place of the trained float arrays.

What it guarantees: every float the user's training moved is either in a blob the server acknowledged, in a
blob still pending (it comes back on a nack), or in the error-feedback residual; nothing is dropped. Messages
without fedcomp's record (evaluate, query, or a plain strategy) pass through untouched. A ``DownlinkError``
(the node cannot rebuild the model the server meant) becomes an error reply, and the server answers with a full
copy. A task that comes again after its update was made (its reply never left) first hands that update back to
the residual, so nothing is counted twice or lost.

Node settings it reads (``context.node_config``): ``state-dir``, a folder that also keeps the session (one server
run's, ``fedcomp.flower.statedir``: owner-only, written atomically before the reply, read before
``context.state``, and locked from loading the session to saving it, so two processes of one node never
interleave; a warm node's next task takes the session it saved from memory while the file is unchanged,
``fedcomp.flower.sessioncache``); ``kernels``, the send-step kernels (``auto``, ``torch``, ``triton``).

Handing the update: a train function may call ``hand_update(pseudo_grad)`` with torch tensors by the model's
array names, on any device: the mod compresses those as they are (a GPU node's update goes to the fused kernels
without a copy through an ArrayRecord) and the reply need not carry the model::

    @app.train()
    def train(msg, context):
        ...                                    # train on the GPU
        hand_update({n: old[n] - p.detach() for n, p in model.named_parameters()}, steps=local_steps)
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": n})}), reply_to=msg)
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedcomp.flower import records
from fedcomp.flower.session import ClientSession
from fedcomp.flower.statedir import StateDir
from fedcomp.task.config import KERNELS, Compression

#: Node-config keys the mod reads: a folder for the client state (also kept in ``context.state``), and the
#: send-step kernels (``auto``, ``torch``, ``triton``).
STATE_DIR_KEY, KERNELS_KEY = "state-dir", "kernels"


@dataclass
class HandedUpdate:
    """What a train function handed with ``hand_update`` (the module docstring, "Handing the update")."""

    tensors: dict[str, torch.Tensor]
    steps: int = 1
    steps_per_epoch: float = 0.0


_HANDED: ContextVar[list[HandedUpdate] | None] = ContextVar("fedcomp_handed_update", default=None)
_TASK: ContextVar[records.ModTask | None] = ContextVar("fedcomp_task", default=None)


def current_task() -> records.ModTask | None:
    """Inside a train function that runs under ``compression_mod``: fedcomp's part of the task it runs (its
    ``task_id``, unique per task of a server run, and ``base_version``); ``None`` elsewhere. A train function may
    seed its batches with the task id, so that a rerun of the same server run draws the same ones.

    >>> current_task() is None  # outside a train function
    True
    """
    return _TASK.get()


def hand_update(pseudo_grad: Mapping[str, torch.Tensor], steps: int = 1, steps_per_epoch: float = 0.0) -> None:
    """Inside a train function that runs under ``compression_mod``: send ``pseudo_grad`` (by the model's array
    names: ``received - trained`` for local training, or a gradient) as it is, torch tensors on any device, instead
    of the mod computing ``received - trained`` from the reply's arrays. A GPU node's update then goes to the
    compressor (the fused kernels) without a copy through an ArrayRecord; the reply need not carry the model.
    ``steps`` local steps were taken (the DGC warm-up schedule counts them; with ``steps_per_epoch`` its epoch is
    ``steps done / steps_per_epoch``, else one train task is one epoch). ``RuntimeError`` outside the mod;
    ``TypeError`` for values that are not torch tensors, ``ValueError`` for ``steps`` not a whole number in
    ``[0, 2**31)`` or ``steps_per_epoch`` not a finite number ``>= 0`` (the node's saved session counts them)."""
    slot = _HANDED.get()
    if slot is None:
        raise RuntimeError("hand_update is for a train function running under compression_mod")
    if not isinstance(pseudo_grad, Mapping) or not all(isinstance(t, torch.Tensor) for t in pseudo_grad.values()):
        raise TypeError("hand_update takes a mapping of array names to torch tensors")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 0 <= steps < 2**31:
        raise ValueError(f"hand_update: steps must be a whole number in [0, 2**31), got {steps!r}")
    per_epoch = steps_per_epoch
    if isinstance(per_epoch, bool) or not isinstance(per_epoch, numbers.Real) or not 0 <= per_epoch < math.inf:
        raise ValueError(f"hand_update: steps_per_epoch must be a finite number >= 0, got {per_epoch!r}")
    slot[:] = [HandedUpdate(dict(pseudo_grad), int(steps), float(per_epoch))]


@contextlib.contextmanager
def _handing() -> Iterator[list[HandedUpdate]]:
    slot: list[HandedUpdate] = []
    token = _HANDED.set(slot)
    try:
        yield slot
    finally:
        _HANDED.reset(token)


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower client mod: see the module docstring. Takes no arguments; the server chooses the compression."""
    if not msg.has_content() or msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return call_next(msg, context)
    task = records.read_mod_task(msg.content)
    if task is None:
        return call_next(msg, context)
    state_dir = str(context.node_config.get(STATE_DIR_KEY, "") or "")
    with StateDir(state_dir).session_lock() if state_dir else contextlib.nullcontext():
        return _train(msg, context, call_next, task, state_dir)


def _train(msg: Message, context: Context, call_next: ClientAppCallable, task: records.ModTask,
           state_dir: str) -> Message:
    compression = Compression.from_flat(task.compression)
    records.unfold(msg.content, (task.arrays_key,))  # the server's folded records: records of their own again
    records.restore_dense(msg.content, task.arrays_key)
    blob_down = records.model_blob(msg.content)
    layout, model_arrays = _received_layout(msg, task)
    spec = layout.spec()
    for key in (records.CONTROL, records.MODEL):  # the user's function and inner mods see the strategy's message
        if key in msg.content:
            del msg.content[key]
    # the update sent is bounded by DP's clipping norm and by the server's max_update_norm (the part over it stays
    # in the residual, for later sends: an honest node is never rejected for its norm)
    max_norm = min((n for n in (_clipping_norm(msg), task.max_norm) if n > 0), default=0.0)
    backend = KERNELS.get(str(context.node_config.get(KERNELS_KEY, "auto")))
    session = ClientSession.load(context, compression, spec, state_dir, backend=backend, run_key=task.run_key,
                                 dir_first=bool(state_dir))
    session.resolve(task.resolutions)

    if blob_down is not None:
        replica = session.receive_model(context, spec, blob_down)
        if replica.version != task.base_version:
            raise records.RecordError(f"downlink model is version {replica.version}, task says {task.base_version}")
        model_arrays = _dense_record(layout, replica.tensors, model_arrays)
        msg.content[task.arrays_key] = model_arrays
    # the update is what the user's training moved: from the arrays it was given (in the model's dtypes)
    received = {n: torch.from_numpy(model_arrays[n].numpy().astype(np.float32)) for n in spec.names}

    started = time.perf_counter()
    token = _TASK.set(task)
    try:
        with _handing() as handed:
            reply = call_next(msg, context)
    finally:
        _TASK.reset(token)
    if reply.has_error():
        session.save(context, state_dir)  # the resolutions were applied; the server nacks this task itself
        return reply
    # a task that comes twice (its first reply lost, or delivered twice) is answered with its first update again:
    # the server applies that seq once, whichever reply it reads
    sent = session.answered(task.task_id)
    if sent is None:
        sent = _send(session, _update(reply, task, layout, received, handed), task, context.node_id, max_norm)
    blob, seq = sent
    session.save(context, state_dir)
    seconds = time.perf_counter() - started  # training, compression and the saved state: the node's compute
    meta = session.reply_meta(task.task_id, seq)
    reply.content = records.add_mod_reply(reply.content, layout, task.arrays_key, blob, meta)
    reply.content[records.CONTROL][records.SECONDS] = float(seconds)  # what density="auto" takes off its link time
    if meta.pending:  # the resync request (docs/protocol.md); a server that does not know the key ignores it
        reply.content[records.CONTROL][records.PENDING_KEY] = list(meta.pending)
    return reply


def _send(session: ClientSession, update: tuple[dict[str, torch.Tensor], int, float], task: records.ModTask,
          node_id: int, max_norm: float) -> tuple[bytes, int]:
    """The pipeline's send of ``update`` (``_update``: the tensors, the local steps and steps per epoch) answering
    ``task``, after the DGC warm-up's epoch and the server's density for it are set; ``(blob, seq)``."""
    delta, steps, per_epoch = update
    session.pipeline.to(next(iter(delta.values())).device if delta else "cpu")
    if per_epoch > 0:  # the train function counts its local steps (hand_update)
        session.steps_done += steps
        session.pipeline.set_epoch(session.steps_done / per_epoch)
    else:
        session.pipeline.set_epoch(session.steps_done)  # one train task = one epoch of the DGC warm-up schedule
        session.steps_done += steps
    if task.density:  # the server's choice for this task (density="auto": fedcomp.server.linkaware)
        session.pipeline.compressor.set_density(task.density)
    return session.send(task.task_id, delta, task.base_version, node_id, max_norm)


def _update(reply: Message, task: records.ModTask, layout: records.ArrayLayout, received: dict[str, torch.Tensor],
            handed: list[HandedUpdate]) -> tuple[dict[str, torch.Tensor], int, float]:
    """The update to send, its local steps and steps per epoch: what ``hand_update`` handed, else ``received -
    trained`` from the reply's model ArrayRecord. That record may hold only the model's arrays: one the server did
    not send would be dropped from the reply, so it is a ``RecordError`` naming it."""
    names = tuple(received)
    if handed:
        got = handed[0]
        _check_arrays("hand_update got", {n: tuple(t.shape) for n, t in got.tensors.items()}, received)
        return {n: got.tensors[n] for n in names}, got.steps, got.steps_per_epoch
    trained = reply.content.array_records.get(task.arrays_key)
    if trained is None:
        raise records.RecordError(f"the train function's reply has no ArrayRecord {task.arrays_key!r} with the model")
    _check_arrays(f"the train function's ArrayRecord {task.arrays_key!r} has",
                  {n: tuple(trained[n].shape) for n in trained if n in received}, received, extra_ok=True)
    unknown = sorted(set(trained) - {n for n, _, _ in layout.entries})
    if unknown:
        raise records.RecordError(f"the train function's ArrayRecord {task.arrays_key!r} has arrays {unknown[:5]} "
                                  "the server did not send: only the model's arrays go back (send others in a "
                                  "record of another name)")
    delta = {n: received[n] - torch.from_numpy(trained[n].numpy().astype(np.float32)) for n in names}
    return delta, 1, 0.0


def _check_arrays(what: str, shapes: dict[str, tuple[int, ...]], received: dict[str, torch.Tensor],
                  extra_ok: bool = False) -> None:
    """``RecordError`` naming the first arrays of the model that ``shapes`` lacks or holds in another shape (and,
    unless ``extra_ok``, those it has beyond the model): an update is never reshaped into the model's arrays."""
    missing = sorted(set(received) - set(shapes))
    extra = [] if extra_ok else sorted(set(shapes) - set(received))
    if missing or extra:
        raise records.RecordError(f"{what} arrays {extra[:5]} the model does not have and lacks {missing[:5]}"
                                  if extra else f"{what} no arrays {missing[:5]} of the model")
    wrong = [n for n in received if shapes[n] != tuple(received[n].shape)]
    if wrong:
        n = wrong[0]
        raise records.RecordError(f"{what} {n} of shape {shapes[n]}, the model's is {tuple(received[n].shape)}"
                                  + (f" ({len(wrong) - 1} more arrays differ)" if len(wrong) > 1 else ""))


def _clipping_norm(msg: Message) -> float:
    """The clipping norm of Flower's client-side DP wrappers in the task's config (0: none). The update sent is
    bounded by it too: error feedback adds earlier residuals to the clipped update, and the server's noise is
    calibrated to the norm (docs/flower.md, "Differential privacy")."""
    for cfg in msg.content.config_records.values():
        value = cfg.get(KEY_CLIPPING_NORM)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return 0.0


def _received_layout(msg: Message, task: records.ModTask) -> tuple[records.ArrayLayout, ArrayRecord]:
    """The model's array layout and the arrays that came as Flower arrays (all of them with a dense downlink)."""
    arrays = msg.content.array_records.get(task.arrays_key, ArrayRecord())
    if task.layout is None and task.arrays_key not in msg.content.array_records:
        raise records.RecordError(f"train message has no ArrayRecord {task.arrays_key!r}")
    return task.layout_of(arrays), arrays


def _dense_record(layout: records.ArrayLayout, floats: dict[str, torch.Tensor], others: ArrayRecord) -> ArrayRecord:
    """The model as the user's function expects it: every array in record order, the update's in their dtype;
    ``RecordError`` when an array the layout says travels dense did not come."""
    out = {}
    for name, shape, dtype in layout.entries:
        if layout.compresses(name, dtype):
            out[name] = Array(floats[name].reshape(shape).numpy().astype(dtype))
        elif name in others:
            out[name] = others[name]
        else:
            raise records.RecordError(f"the layout's array {name!r} ({dtype}) travels dense but is not in the task")
    return ArrayRecord(out)
