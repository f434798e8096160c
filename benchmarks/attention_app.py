"""An ordinary Flower app with the two lines: a small self-attention classifier over digits rows, 4 nodes on
Flower's simulation engine (``run_simulation``), 10 rounds or versions.

``python benchmarks/attention_app.py sync``: stock FedProx on Flower's own sync rounds (``Compressed``'s default
loop); node 2's state dir holds a FIFO planted as its session file, so its tasks fail with one line and the run goes
on. ``python benchmarks/attention_app.py async``: stock FedAvgM, async on fedcomp's loop, ``normalize="sum"``,
federated evaluation every 2 versions waiting ``fed_eval_timeout``. Prints the run key fedcomp's record carried
(``RUNKEY``), accuracy per version, and wall times (``start()``; ``run_simulation``: also Ray's start).
"""
import os
import shutil
import sys
import tempfile
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvgM, FedProx
from flwr.simulation import run_simulation
from sklearn.datasets import load_digits
from torch import nn

from fedcomp.flower import Compressed, compression_mod

X, Y = load_digits(return_X_y=True)
X = torch.tensor(X / 16.0, dtype=torch.float32).reshape(-1, 8, 8)
Y = torch.tensor(Y)
NODES, MODE = 4, sys.argv[1]
PLANTED = tempfile.mkdtemp(prefix="attn-state-")  # node 2's state dir in the sync run
os.mkfifo(os.path.join(PLANTED, "client-state.pt"))  # planted: reading it would block for good


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h.mean(1))


def acc(model, lo=1500, hi=1797):
    with torch.no_grad():
        return (model(X[lo:hi]).argmax(1) == Y[lo:hi]).float().mean().item()


SEEN = []


def spy(msg, context, call_next):
    """Outside compression_mod: notes the run key fedcomp's record carries; gives node 2 the planted state dir."""
    if msg.has_content() and "fedcomp" in msg.content.config_records:
        key = int(msg.content.config_records["fedcomp"].get("run-key", 0))
        if key not in SEEN:
            SEEN.append(key)
            print(f"RUNKEY {key:x}", flush=True)
    if MODE == "sync" and int(context.node_config["partition-id"]) == 2:
        context.node_config["state-dir"] = PLANTED
    return call_next(msg, context)


client = ClientApp(mods=[spy, compression_mod])


@client.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    model = Attn()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.arange(pid, 1500, NODES)
    g = torch.Generator().manual_seed(int(time.time_ns()) % 1000)
    for _ in range(10):
        b = idx[torch.randint(len(idx), (32,), generator=g)]
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[b]), Y[b]).backward()
        opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(idx)})}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    model = Attn()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    lo = 1500 + pid * 70
    return Message(RecordDict({"metrics": MetricRecord({"eval-acc": acc(model, lo, lo + 70), "num-examples": 70})}),
                   reply_to=msg)


server = ServerApp()
RESULT = {}


@server.main()
def main(grid: Grid, context: Context) -> None:
    if MODE == "sync":
        strategy = Compressed(FedProx(fraction_evaluate=0.0, proximal_mu=0.01), "dgc+int8", density=0.1)
    else:
        strategy = Compressed(FedAvgM(fraction_evaluate=1.0, server_momentum=0.5), "dgc+int8", density=0.1,
                              mode="async", buffer_size=2, normalize="sum", fed_eval_every=2, fed_eval_timeout=30.0)

    def evaluate_fn(version, arrays):
        m = Attn()
        m.load_state_dict(arrays.to_torch_state_dict())
        RESULT[version] = acc(m)
        return MetricRecord({"accuracy": RESULT[version]})

    t0 = time.perf_counter()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Attn().state_dict()), num_rounds=10, timeout=60.0,
                            evaluate_fn=evaluate_fn)
    RESULT["start_wall_s"] = time.perf_counter() - t0
    RESULT["fed"] = {k: dict(v) for k, v in result.evaluate_metrics_clientapp.items()}


if __name__ == "__main__":
    t0 = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=NODES,
                   backend_config={"client_resources": {"num_cpus": 1}})
    print("accuracy by version/round:", {k: round(v, 3) for k, v in RESULT.items() if isinstance(k, int)})
    print("federated evaluation:", {k: round(v.get("eval-acc", -1), 3) for k, v in RESULT.get("fed", {}).items()})
    print(f"start() wall {RESULT.get('start_wall_s', float('nan')):.1f} s; run_simulation wall "
          f"{time.perf_counter() - t0:.1f} s")
    shutil.rmtree(PLANTED)
