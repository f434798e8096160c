"""The compatibility matrix's pieces: model families, stock strategies, one generic Flower app, and the checks.

A *cell* is (model family, strategy, fedcomp settings): the same ordinary Flower app (its own model, scikit-learn's
digits split over ``NODES`` nodes, one epoch of SGD per round) runs with ``compression_mod`` and
``Compressed(strategy)`` on the in-process federation of ``benchmarks/flowerkit.py``, optionally next to its plain
twin. ``run_cell`` returns the accuracy after every round, the uplink Flower object bytes and, for compressed
runs, the conservation error (Σ applied + Σ residuals + Σ pending vs Σ computed, worst relative error over
every node and array; sync rounds and ``mode="async"`` alike). ``tests/test_compat.py`` asserts on it;
``benchmarks/compat_matrix.py`` prints the table of docs/flower.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp import strategy as fs
from sklearn.datasets import load_digits
from torch import nn

from benchmarks.flowerkit import LocalGrid, server_identity
from fedcomp.flower import ClientSession, Compressed, compression_mod, records

NODES = 4
LR = 0.05


# ---- data ----------------------------------------------------------------------------------------------------
@cache
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def partition(node: int, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node ``node``'s share of the first 1,500 images (every ``nodes``-th one)."""
    x, y = digits()
    return x[:1500][node::nodes], y[:1500][node::nodes]


def test_set() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = digits()
    return x[1500:], y[1500:]


# ---- model families ------------------------------------------------------------------------------------------
class Tokens(nn.Module):
    """A one-block transformer encoder (LayerNorm) over the 8 rows of an 8x8 digit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.pos = nn.Parameter(torch.zeros(8, 32))
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x.view(-1, 8, 8)) + self.pos).mean(1))


class Adapted(nn.Module):
    """A frozen base layer with a LoRA-style low-rank adapter and a trainable head; only the adapter and the head
    travel (``record``). The base is the same on every node: built from a fixed seed, never sent."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        self.base = nn.Linear(64, 128)
        with torch.no_grad():
            self.base.weight.copy_(torch.randn(128, 64, generator=gen) / 8)
            self.base.bias.zero_()
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, 64, generator=gen) / 8)
        self.lora_b = nn.Parameter(torch.zeros(128, rank))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + x @ self.lora_a.T @ self.lora_b.T))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def bn_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 10),
    )


def frozen() -> nn.Module:
    model = mlp()
    gen = torch.Generator().manual_seed(99)  # the frozen layer is the same everywhere and stays in the state_dict
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(128, 64, generator=gen) / 8)
    model[0].requires_grad_(False)
    return model


@dataclass(frozen=True)
class Family:
    """How an app of this family builds its model and exchanges it: ``record(model)`` is the ArrayRecord it
    sends (the user's choice: the whole ``state_dict`` or part of it), ``load`` the inverse."""

    make: Callable[[], nn.Module]
    dtype: torch.dtype = torch.float32
    trainable_only: bool = False  # the record holds only the arrays that train (adapter-only)
    wire_dtype: torch.dtype | None = None  # cast for Flower (which cannot carry bf16): float32
    lr: float = LR  # local SGD learning rate
    seed: int = 0  # torch's seed for the initial model

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.make().to(self.dtype)

    def record(self, model: nn.Module) -> ArrayRecord:
        state = model.state_dict()
        if self.trainable_only:
            keep = {n for n, p in model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in keep}
        if self.wire_dtype is not None:
            state = {k: v.to(self.wire_dtype) if v.is_floating_point() else v for k, v in state.items()}
        return ArrayRecord(state)

    def load(self, model: nn.Module, record: ArrayRecord) -> None:
        model.load_state_dict(record.to_torch_state_dict(), strict=not self.trainable_only)


FAMILIES: dict[str, Family] = {
    "mlp": Family(mlp),
    "bn-cnn": Family(bn_cnn),
    "transformer": Family(Tokens, lr=0.2),
    "frozen": Family(frozen),
    "adapter": Family(Adapted, trainable_only=True),
    "fp16": Family(mlp, dtype=torch.float16),
    "bf16": Family(mlp, dtype=torch.bfloat16, wire_dtype=torch.float32),
}


def train(family: Family, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], seed: int) -> float:
    """One epoch of SGD (momentum 0.9, batches of 32); the mean loss."""
    x, y = data
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=family.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    total = 0.0
    batches = torch.randperm(len(x), generator=gen).split(32)
    for idx in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[idx].to(family.dtype)).float(), y[idx])
        loss.backward()
        opt.step()
        total += loss.item()
    return total / len(batches)


def accuracy(family: Family, arrays: ArrayRecord) -> float:
    model = family.build()
    family.load(model, arrays)
    return accuracy_of(family, model)


def accuracy_of(family: Family, model: nn.Module) -> float:
    model.eval()
    x, y = test_set()
    with torch.no_grad():
        return float((model(x.to(family.dtype)).argmax(1) == y).float().mean())


def client_app(family: Family, mods: list) -> ClientApp:
    """The family's ordinary Flower ClientApp (train, and evaluate on the held-out images) with ``mods``."""
    app = ClientApp(mods=mods)

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        model = family.build()
        family.load(model, msg.content["arrays"])
        node = int(context.node_config["partition-id"])
        data = partition(node, int(context.node_config["num-partitions"]))
        seed = int(msg.content["config"].get("server-round", 0)) * 1000 + node
        loss = train(family, model, data, seed)
        metrics = MetricRecord({"train_loss": loss, "num-examples": len(data[0])})
        return Message(RecordDict({"arrays": family.record(model), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        model = family.build()
        family.load(model, msg.content["arrays"])
        metrics = MetricRecord({"eval-acc": accuracy_of(family, model), "num-examples": len(test_set()[0])})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


# ---- strategies ----------------------------------------------------------------------------------------------
def _common(n: int) -> dict[str, Any]:
    return {"fraction_evaluate": 0.0, "min_train_nodes": n, "min_available_nodes": n}


#: Every strategy of ``flwr.serverapp.strategy`` that trains arrays, with the DP wrappers around FedAvg. Settings
#: are the stock ones except FedOpt's server learning rate ``eta``: the best of 0.01-0.3 for the plain strategy on
#: this task (benchmarks/compat_matrix.py; docs/flower.md).
STRATEGIES: dict[str, Callable[[int], fs.Strategy]] = {
    "FedAvg": lambda n: fs.FedAvg(**_common(n)),
    "FedProx": lambda n: fs.FedProx(**_common(n), proximal_mu=0.01),
    "FedAvgM": lambda n: fs.FedAvgM(**_common(n), server_learning_rate=1.0, server_momentum=0.5),
    "FedAdam": lambda n: fs.FedAdam(**_common(n), eta=0.07),
    "FedYogi": lambda n: fs.FedYogi(**_common(n), eta=0.03),
    "FedAdagrad": lambda n: fs.FedAdagrad(**_common(n), eta=0.03),
    "FedMedian": lambda n: fs.FedMedian(**_common(n)),
    "FedTrimmedAvg": lambda n: fs.FedTrimmedAvg(**_common(n), beta=0.25),
    "Krum": lambda n: fs.Krum(**_common(n), num_malicious_nodes=0),
    "MultiKrum": lambda n: fs.MultiKrum(**_common(n), num_malicious_nodes=0, num_nodes_to_select=2),
    "Bulyan": lambda n: fs.Bulyan(**_common(n), num_malicious_nodes=0),
    "QFedAvg": lambda n: fs.QFedAvg(client_learning_rate=LR, q=0.1, **_common(n)),
    "DP-server-fixed": lambda n: fs.DifferentialPrivacyServerSideFixedClipping(
        fs.FedAvg(**_common(n)), noise_multiplier=0.01, clipping_norm=2.0, num_sampled_clients=n),
    "DP-server-adaptive": lambda n: fs.DifferentialPrivacyServerSideAdaptiveClipping(
        fs.FedAvg(**_common(n)), noise_multiplier=0.01, num_sampled_clients=n, initial_clipping_norm=1.0),
    "DP-client-fixed": lambda n: fs.DifferentialPrivacyClientSideFixedClipping(
        fs.FedAvg(**_common(n)), noise_multiplier=0.01, clipping_norm=2.0, num_sampled_clients=n),
    "DP-client-adaptive": lambda n: fs.DifferentialPrivacyClientSideAdaptiveClipping(
        fs.FedAvg(**_common(n)), noise_multiplier=0.01, num_sampled_clients=n, initial_clipping_norm=1.0),
}

#: Flower's client-side DP mods, for the strategies that need one: placed inside ``compression_mod``.
CLIENT_MODS = {"DP-client-fixed": fixedclipping_mod, "DP-client-adaptive": adaptiveclipping_mod}


# ---- conservation --------------------------------------------------------------------------------------------
class Computed:
    """A mod placed right inside ``compression_mod``: adds up per node the update each train call computed
    (received - trained, over the float arrays, as float32), which is what the mod compresses."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, msg: Message, ctx: Context, call_next) -> Message:
        if msg.metadata.message_type != "train":
            return call_next(msg, ctx)
        got = {k: a.numpy().astype(np.float32) for k, a in msg.content["arrays"].items()
               if records.ArrayLayout.is_float(a.dtype)}
        reply = call_next(msg, ctx)
        if reply.has_error():
            return reply
        mine = self.sums.setdefault(ctx.node_id, {k: torch.zeros(v.shape) for k, v in got.items()})
        for k, a in reply.content["arrays"].items():
            if k in got:
                mine[k] += torch.from_numpy(np.asarray(got[k] - a.numpy().astype(np.float32)))  # 0-d: a scalar
        return reply


class StagedGrid(LocalGrid):
    """A ``LocalGrid`` where node N is available from round ``joins[N]`` on (``Recorded`` tells it the round)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.joins: dict[int, int] = {}
        self.round = 0

    def get_node_ids(self) -> list[int]:
        return [n for n in self.apps if self.joins.get(n, 0) <= self.round]


class Recorded(Compressed):
    """``Compressed`` that also records the updates it applied: in sync mode those whose acks it released (the
    aggregation returned a model), in async mode every update the buffer took (``audit``: it is in the next
    version, and acked)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.applied: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # client -> seq -> dense update

    def configure_train(self, server_round, arrays, config, grid):
        if isinstance(grid, StagedGrid):
            grid.round = server_round
        return super().configure_train(server_round, arrays, config, grid)

    def audit(self, update, staleness):
        super().audit(update, staleness)
        self.applied.setdefault(update.client_id, {})[update.seq] = update.to_dense()

    def _aggregate(self, server_round, accepted):
        arrays, metrics = super()._aggregate(server_round, accepted)
        if arrays is not None:
            for _, update, _ in accepted:
                self.applied.setdefault(update.client_id, {})[update.seq] = update.to_dense()
        return arrays, metrics


def conservation_error(strategy: Recorded, grid: LocalGrid, computed: Computed) -> float:
    """Worst relative error of Σ applied + Σ residuals + Σ pending against Σ computed, over nodes and arrays."""
    spec, worst = strategy.spec, 0.0
    for node, sums in computed.sums.items():
        session = ClientSession.load(grid.contexts[node], strategy.compression, spec)
        applied = strategy.applied.get(node, {})
        for n in spec.names:
            total = sum((u[n] for u in applied.values()), torch.zeros(spec.shape(n)))
            try:
                total = total + session.pipeline.memory.residual(n).reshape(spec.shape(n))
            except KeyError:
                pass
            for seq, update in session.pipeline.pending.items():
                if seq not in applied:  # applied ones stay pending until their ack arrives with the next task
                    total = total + update.to_dense()[n]
            scale = max(float(sums[n].norm()), 1e-12)
            worst = max(worst, float((sums[n] - total).norm()) / scale)
    return worst


def _payload(reply: Message) -> int:
    """Payload bytes of a train reply: its fedcomp blob, else the data of its arrays."""
    if records.CONTROL in reply.content.config_records:
        return len(records.read_blob(reply.content, records.UPDATE))
    return sum(len(a.data) for rec in reply.content.array_records.values() for a in rec.values())


# ---- one cell ------------------------------------------------------------------------------------------------
@dataclass
class Cell:
    """What a run of one cell gives."""

    accuracy: dict[int, float]
    uplink_bytes: float  # Flower object bytes of the train replies the server received, summed
    payload_bytes: float  # their payload: the fedcomp blobs, or the plain replies' array data
    replies: int
    conservation: float | None = None  # None for a plain run
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    trained_nodes: set[int] = field(default_factory=set)  # the nodes whose update was computed at least once
    grid: LocalGrid | None = None  # the federation, with every message sent and received
    strategy: Recorded | None = None  # the compressed run's strategy, with what it applied (None for a plain run)
    computed: Computed | None = None  # what each node computed (conservation_error(strategy, grid, computed))


def run_cell(
    family: str,
    strategy: str,
    rounds: int,
    *,
    compressed: bool = True,
    compressor: str = "dgc+int8",
    nodes: int = NODES,
    drop: Callable[[int, Message], bool] | None = None,
    extra_mods: list | None = None,
    fraction_train: float = 1.0,
    min_train: int | None = None,
    late_node: int = 0,
    strategy_options: dict[str, Any] | None = None,
    evaluate: bool = False,
    **options: Any,
) -> Cell:
    """Run ``strategy`` on the ``family`` app for ``rounds`` rounds, compressed (``Compressed(..., compressor,
    **options)`` and ``compression_mod``) or plain. ``extra_mods`` go outside ``compression_mod``;
    ``fraction_train`` < 1 samples nodes (FedAvg family); ``min_train`` lets rounds go on with fewer replies;
    ``late_node`` = R: the last node joins the federation at round R (compressed runs); ``strategy_options``
    set attributes of the wrapped strategy (``{"eta": 0.1}``); ``evaluate``: federated evaluation on every node
    each round too."""
    fam = FAMILIES[family]
    inner = [CLIENT_MODS[strategy]] if strategy in CLIENT_MODS else []
    computed = Computed()
    mods = [*(extra_mods or []), compression_mod, computed, *inner] if compressed else [*(extra_mods or []), *inner]
    app = client_app(fam, mods)
    apps = {100 + i: (app, {"partition-id": i, "num-partitions": nodes}) for i in range(nodes)}
    grid = StagedGrid(apps, {}, drop=drop)
    if late_node:
        grid.joins[100 + nodes - 1] = late_node
    base = STRATEGIES[strategy](nodes)
    for key, value in (strategy_options or {}).items():
        if not hasattr(base, key):
            raise AttributeError(f"{type(base).__name__} has no attribute {key!r}")
        setattr(base, key, value)
    if evaluate:
        base.fraction_evaluate, base.min_evaluate_nodes = 1.0, nodes
    if fraction_train < 1 or min_train is not None:
        base.fraction_train = fraction_train
        base.min_train_nodes = base.min_available_nodes = min_train or 1
    wrapped = Recorded(base, compressor, **options) if compressed else base
    with server_identity():
        result = wrapped.start(
            grid,
            fam.record(fam.build()),
            num_rounds=rounds,
            train_config=ConfigRecord({"lr": LR}),
            evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": accuracy(fam, arrays)}),
        )
    train = [r for r in grid.replies if not r.has_error() and r.metadata.message_type == "train"]
    acc = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items() if r > 0}
    return Cell(
        acc,
        float(sum(records.flower_size(r)[0] for r in train)),
        float(sum(_payload(r) for r in train)),
        len(train),
        conservation_error(wrapped, grid, computed) if compressed else None,
        {r: {**dict(m), **dict(result.evaluate_metrics_clientapp.get(r, {}))}
         for r, m in result.train_metrics_clientapp.items()},
        set(computed.sums),
        grid,
        wrapped if compressed else None,
        computed if compressed else None,
    )
