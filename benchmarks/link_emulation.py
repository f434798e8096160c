"""Real link emulation: SuperLink and SuperNodes in their own network namespaces, joined by veth pairs shaped
with tc, against the virtual-clock prediction for the same link profile.

    sudo python benchmarks/link_emulation.py [--up-kbit 20 --down-kbit 80 --rtt-ms 0 --loss 0] [--versions 6]

Topology: namespace ``fcl<pid>s`` runs ``flower-server`` (SuperLink + ServerApp); namespace ``fcl<pid>c0`` runs
one ``flower-client``. A veth pair joins them (10.77.0.1 <-> 10.77.0.2, private addresses that exist only in
those namespaces). tc shapes each direction at the sender: ``tbf`` for rate (client side = uplink, server side =
downlink) and, where the kernel has it, ``netem`` for delay (``rtt-ms / 2`` each way) and loss. Nothing leaves the
two namespaces; every namespace and link is deleted on exit (also on Ctrl-C or an error).

Two short async runs (K = 1, one client, so each version is one task round trip) are made: one unshaped, one
shaped. Measured link cost per update = mean version interval (shaped) - (unshaped). The prediction of
``fedcomp.sim.links.LinkProfile.transfer_s`` (the virtual clock's: rtt + down_bytes/down_bw + up_bytes/up_bw) is
computed for three byte counts per update: payload bytes, Flower object bytes, and the bytes the veth
interfaces really carried (TCP/IP, HTTP, polls and heartbeats included). The ratio measured / predicted is
printed for each, and written as JSON with ``--json``.

Needs root, ``ip netns`` and ``tc``; where the machine does not allow them the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcomp.sim.links import LinkProfile  # noqa: E402
from fedcomp.tools.processes import ManagedProcess, flower_executable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVER_IP, CLIENT_IP = "10.77.0.1", "10.77.0.2"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


class Namespaces:
    """Two private namespaces joined by one veth pair; ``close()`` deletes them (idempotent)."""

    def __init__(self) -> None:
        tag = f"fcl{os.getpid()}"
        self.server, self.client = f"{tag}s", f"{tag}c0"
        self.vs, self.vc = f"{tag}vs", f"{tag}vc"
        self.made: list[str] = []

    def open(self) -> None:
        for ns in (self.server, self.client):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh(
            "ip",
            "link",
            "add",
            self.vs,
            "netns",
            self.server,
            "type",
            "veth",
            "peer",
            "name",
            self.vc,
            "netns",
            self.client,
        )
        sh("ip", "-n", self.server, "addr", "add", f"{SERVER_IP}/24", "dev", self.vs)
        sh("ip", "-n", self.client, "addr", "add", f"{CLIENT_IP}/24", "dev", self.vc)
        for ns, dev in ((self.server, self.vs), (self.client, self.vc)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            # no segmentation offload: tbf then sees (and times) real packets
            if shutil.which("ethtool"):
                sh(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "ethtool",
                    "-K",
                    dev,
                    "tso",
                    "off",
                    "gso",
                    "off",
                    "gro",
                    "off",
                    check=False,
                )

    def shape(self, ns: str, dev: str, kbit: float, delay_ms: float, loss: float, netem: bool) -> None:
        """Egress of ``dev``: netem (delay, loss; when available) then tbf at ``kbit``."""
        sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        burst = max(4096, int(kbit * 1000 / 8 / 50))  # >= one MTU, ~20 ms of tokens
        tbf = ["tbf", "rate", f"{kbit}kbit", "burst", str(burst), "latency", "2s"]
        if netem and (delay_ms or loss):
            sh(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                f"{delay_ms}ms",
                "loss",
                f"{100 * loss}%",
            )
            sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)

    def unshape(self) -> None:
        for ns, dev in ((self.server, self.vs), (self.client, self.vc)):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def tx_bytes(self, ns: str, dev: str) -> int:
        out = sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes").stdout
        return int(out.strip())

    def close(self) -> None:
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)
        self.made = []


def can_run() -> str:
    """Empty when namespaces and tc work here, else why not (plainly)."""
    if os.geteuid() != 0:
        return "needs root (ip netns and tc change network configuration)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"'{tool}' not found (Debian: apt-get install iproute2)"
    probe = f"fclprobe{os.getpid()}"
    res = sh("ip", "netns", "add", probe, check=False)
    if res.returncode:
        return f"network namespaces are not allowed here: {res.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return ""


def netem_available(ns: Namespaces) -> bool:
    res = sh("tc", "-n", ns.client, "qdisc", "add", "dev", ns.vc, "root", "netem", "delay", "1ms", check=False)
    sh("tc", "-n", ns.client, "qdisc", "del", "dev", ns.vc, "root", check=False)
    return res.returncode == 0


def one_run(ns: Namespaces, args: argparse.Namespace, work: Path, label: str) -> dict:
    """One async run (one client, K = 1); returns version intervals and byte counts."""
    out, port = work / label, 29500 + os.getpid() % 1000
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    py = sys.executable
    server_argv = [
        "ip",
        "netns",
        "exec",
        ns.server,
        py,
        "-m",
        "server_app.launcher",
        "--insecure",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--mode",
        "async",
        "--versions",
        str(args.versions),
        "--buffer-size",
        "1",
        "--min-clients",
        "1",
        "--task-timeout",
        "300",
        "--out",
        str(out),
        "--local-steps",
        "5",
        "--quiet",
        "-c",
        "run-timeout=900",
        "-c",
        "node-wait=120",
    ]
    client_argv = [
        "ip",
        "netns",
        "exec",
        ns.client,
        py,
        "-m",
        "clients.launcher",
        "--server",
        f"{SERVER_IP}:{port}",
        "--insecure",
        "--partition-id",
        "0",
        "--num-partitions",
        "1",
        "--flwr-home",
        str(work / "c-home"),
        "--device-class",
        "phone",
    ]
    procs: list[ManagedProcess] = []
    tx0 = (ns.tx_bytes(ns.server, ns.vs), ns.tx_bytes(ns.client, ns.vc))
    try:
        procs.append(ManagedProcess("server", server_argv, work / f"{label}-server.log", env, cwd=ROOT))
        procs.append(ManagedProcess("client", client_argv, work / f"{label}-client.log", env, cwd=ROOT))
        rc = procs[0].proc.wait(timeout=args.timeout)
    finally:
        for p in reversed(procs):
            p.stop()
    if rc != 0:
        raise RuntimeError(f"{label} run failed (exit {rc}):\n{procs[0].tail(30)}")
    down = ns.tx_bytes(ns.server, ns.vs) - tx0[0]
    up = ns.tx_bytes(ns.client, ns.vc) - tx0[1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    times = [r["time"] for r in rows]
    intervals = [b - a for a, b in zip(times, times[1:], strict=False)]
    t = summary["totals"]
    n = max(t["messages_up"], 1)
    return {
        "versions": summary["versions"],
        "interval_s": sum(intervals) / max(len(intervals), 1),
        "payload_up": t["payload_bytes_up"] / n,
        "payload_down": t["payload_bytes_down"] / max(t["messages_down"], 1),
        "flower_up": t["flower_bytes_up"] / n,
        "flower_down": t["flower_bytes_down"] / max(t["messages_down"], 1),
        "link_up_total": up,
        "link_down_total": down,
        "updates": n,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--up-kbit", type=float, default=20.0, help="client uplink rate (default 20: GPRS)")
    ap.add_argument("--down-kbit", type=float, default=80.0, help="client downlink rate (default 80: GPRS)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip delay (netem; ignored if unavailable)")
    ap.add_argument("--loss", type=float, default=0.0, help="per-packet loss each way (netem)")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    why = can_run()
    if why:
        print(f"link emulation not possible on this machine: {why}. Nothing was changed.")
        return 0
    for tool in ("flower-superlink", "flower-supernode"):
        flower_executable(tool)
    ns = Namespaces()
    work = Path(tempfile.mkdtemp(prefix="fedcomp-links-"))
    try:
        ns.open()
        netem = netem_available(ns)
        if not netem and (args.rtt_ms or args.loss):
            print("tc netem is not available in this kernel: delay and loss are NOT emulated (rate only, via tbf)")
        rtt = args.rtt_ms if netem else 0.0
        loss = args.loss if netem else 0.0
        base = one_run(ns, args, work, "unshaped")
        ns.shape(ns.client, ns.vc, args.up_kbit, rtt / 2, loss, netem)
        ns.shape(ns.server, ns.vs, args.down_kbit, rtt / 2, loss, netem)
        shaped = one_run(ns, args, work, "shaped")
        ns.unshape()
    finally:
        ns.close()
    link = LinkProfile("emulated", args.up_kbit * 1000 / 8, args.down_kbit * 1000 / 8, rtt / 1000, loss)
    measured = shaped["interval_s"] - base["interval_s"]
    per_update_link = (shaped["link_up_total"] / shaped["updates"], shaped["link_down_total"] / shaped["updates"])
    predictions = {
        "payload": link.transfer_s(shaped["payload_up"], shaped["payload_down"]),
        "flower": link.transfer_s(shaped["flower_up"], shaped["flower_down"]),
        "link": link.transfer_s(*per_update_link),
    }
    result = {
        "profile": {"up_kbit": args.up_kbit, "down_kbit": args.down_kbit, "rtt_ms": rtt, "loss": loss, "netem": netem},
        "unshaped": base,
        "shaped": shaped,
        "measured_link_s_per_update": measured,
        "bytes_per_update": {
            "payload": [shaped["payload_up"], shaped["payload_down"]],
            "flower": [shaped["flower_up"], shaped["flower_down"]],
            "link": list(per_update_link),
        },
        "predicted_s_per_update": predictions,
        "ratio_measured_over_predicted": {k: measured / v for k, v in predictions.items() if v > 0},
    }
    print(
        f"profile: up {args.up_kbit} kbit/s, down {args.down_kbit} kbit/s, rtt {rtt} ms, loss {loss} "
        f"(netem {'on' if netem else 'unavailable'})"
    )
    print(
        f"version interval: unshaped {base['interval_s']:.2f} s, shaped {shaped['interval_s']:.2f} s "
        f"-> link cost {measured:.2f} s per update"
    )
    print(f"{'bytes counted':<14} {'up B':>9} {'down B':>9} {'predicted s':>12} {'measured/pred':>14}")
    for k in ("payload", "flower", "link"):
        up, down = result["bytes_per_update"][k]
        print(
            f"{k:<14} {up:>9.0f} {down:>9.0f} {predictions[k]:>12.2f} "
            f"{result['ratio_measured_over_predicted'].get(k, float('nan')):>14.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
