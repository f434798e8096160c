"""Chaos soak: a loopback deployment with the defaults under random faults, then ``fedcomp check`` on what it left.

    python benchmarks/chaos.py [--duration 480] [--clients 3] [--seed 0] [--json chaos.json]

One ``flower-server`` (async, queued tasks, ``density=auto``, a checkpoint every version, the SuperLink's state in
a database file) and ``--clients`` ``flower-client`` nodes (warm workers, each with its own ``--state-dir``) run on
127.0.0.1. For ``--duration`` seconds a seeded random fault comes every 10–30 s (``--gap``), the kinds drawn from a
shuffled bag so every kind comes once per round of the bag:

* ``client-kill``: the client machine dies (SIGKILL to ``flower-client`` and every process under it), and comes
  back 1–3 s later on the same ``--state-dir`` and ``--flwr-home``;
* ``worker-kill``: SIGKILL to the node's warm worker (the ``clients.worker`` child of a ``flower-client``); its
  launcher restarts it;
* ``client-freeze``: SIGSTOP to every process of one client for 8–20 s (``--freeze``), then SIGCONT;
* ``server-kill``: SIGKILL to ``flower-server``, its SuperLink and ServerApp, then ``flower-server --resume`` from
  the last checkpoint 2 s later (only once the running server has produced a version);
* ``slow-link``: where the machine allows it (root, ``ip``, ``tc``, network namespaces), the whole deployment runs
  in a private network namespace and its loopback is shaped with ``tbf`` (``--slow-kbit``) for 8–20 s, with
  ``netem`` random loss (``--loss``) too when the kernel has it. Only the namespace's loopback is touched.

When the time is up the run finishes by itself: the server is killed once more and resumed with a target of the
checkpoint's version plus ``--tail`` versions, and the soak waits for it to exit. The clients are then stopped
and ``fedcomp check OUT --client-state DIR ... --json`` accounts for every update. Printed and written (``--json``):
faults by kind, versions, applied / nacked / duplicate, the check's verdict, the time each fault cost and every
exit code. Every process started is stopped by PID at the end, whatever happens.

Lost and applied twice, from the check's per-client rows: ``lost`` = updates sent but neither acked, nacked nor
pending, plus pending updates stranded, plus updates a client counts applied that its nodes' ledgers do not;
``applied_twice`` = updates the ledgers of a client's nodes (same incarnation) count applied beyond what the
client knows applied (acked, or an ack waiting): those went back into its residual as nacks while in the model.
The exit code is 0 only with both 0, check exit 0, the last server's exit 0 and no hang.

Time lost per fault: ``next_version_s`` is the wait from the fault to the next version written, ``lost_s`` that
wait minus the run's median interval between versions (0 when shorter); ``back_s`` (client faults) is the time
from the end of the fault to the client's next saved state (its next task done).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcomp.tools.processes import ManagedProcess, command_line, descendants, free_port, signal_pids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SoakConfig:
    """What the soak does. ``duration_s``: fault phase; ``min_each``: go on past it until every available kind
    came this often; ``tail``: versions after the last resume; ``finish_s``: how long the last server may take
    before the soak calls it a hang; ``links``: ``auto`` (shape where the machine allows it) or ``off``."""

    duration_s: float = 480.0
    clients: int = 3
    seed: int = 0
    gap_s: tuple[float, float] = (10.0, 30.0)
    freeze_s: tuple[float, float] = (8.0, 20.0)
    min_each: int = 1
    tail: int = 6
    task_timeout: float = 45.0
    links: str = "auto"
    slow_kbit: int = 800
    loss: float = 0.02
    finish_s: float = 1200.0
    work: str = ""


@dataclass
class FaultRecord:
    kind: str
    target: str
    at_s: float  # since the soak started
    hold_s: float = 0.0
    finale: bool = False
    started: float = 0.0  # monotonic
    ends: float = 0.0  # monotonic: when finish() runs
    next_version_s: float | None = None
    lost_s: float | None = None
    back_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def command(module: str, script: str) -> list[str]:
    """The console script next to this interpreter, else ``python -m module``."""
    exe = Path(sys.executable).with_name(script)
    return [str(exe)] if exe.exists() else [sys.executable, "-m", module]


def tree(proc: ManagedProcess) -> list[int]:
    """The process, its live descendants and every descendant it was seen with."""
    pids = [proc.pid, *proc.remember_children()]
    for p in list(proc.known):
        pids += descendants(p)
    return list(dict.fromkeys([*pids, *proc.known]))


def kill_tree(proc: ManagedProcess) -> None:
    """The machine dies: SIGKILL the process and every process under it, no goodbye."""
    pids = tree(proc)
    proc.known.update(pids)
    signal_pids([*pids, proc.pid], signal.SIGKILL)
    try:
        proc.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


class Links:
    """A private network namespace whose loopback can be slowed (``tbf``) and made lossy (``netem``) for a while.
    ``why`` says what the machine does not allow; ``prefix`` runs a command inside the namespace."""

    def __init__(self, mode: str, slow_kbit: int, loss: float) -> None:
        self.name, self.slow_kbit, self.loss = f"fcchaos{os.getpid()}", slow_kbit, loss
        self.made, self.lossy, self.why = False, False, ""
        if mode == "off":
            self.why = "turned off (--links off)"
            return
        if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
            self.why = "needs root with ip and tc (network namespaces and qdiscs)"
            return
        made = sh("ip", "netns", "add", self.name)
        if made.returncode != 0:
            self.why = f"ip netns add failed: {made.stderr.strip()[:120]}"
            return
        self.made = True
        sh("ip", "-n", self.name, "link", "set", "lo", "mtu", "1500")  # tbf's burst must hold a packet
        sh("ip", "-n", self.name, "link", "set", "lo", "up")
        probe = self.tc("add", f"netem loss {loss * 100:g}%")
        self.lossy = probe.returncode == 0
        self.tc("del", "")
        if not self.lossy:
            self.why = f"no random loss: tc netem refused ({probe.stderr.strip()[:80]}); slow links only (tbf)"
        tbf = self.tc("add", self._tbf())
        self.tc("del", "")
        if tbf.returncode != 0:
            self.close()
            self.why = f"tc tbf refused ({tbf.stderr.strip()[:80]})"

    @property
    def available(self) -> bool:
        return self.made

    def _tbf(self) -> str:
        return f"tbf rate {self.slow_kbit}kbit burst 16kb latency 2s"

    def tc(self, op: str, qdisc: str) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.name, "tc", "qdisc", op, "dev", "lo", "root", *qdisc.split())

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name] if self.made else []

    def degrade(self) -> str:
        """Slow (and lossy) loopback until ``restore``; returns what was set."""
        if self.lossy:  # netem: loss, then tbf under it for the rate
            self.tc("add", f"handle 1: netem loss {self.loss * 100:g}%")
            sh("ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "parent", "1:", "handle", "2:",
               *self._tbf().split())
            return f"{self.slow_kbit} kbit/s, {self.loss:.0%} loss"
        self.tc("add", self._tbf())
        return f"{self.slow_kbit} kbit/s"

    def restore(self) -> None:
        if self.made:
            self.tc("del", "")

    def close(self) -> None:
        if self.made:
            self.restore()
            sh("ip", "netns", "del", self.name)
            self.made = False


class Deployment:
    """The server and the clients of the soak, their outputs, and what is watched each tick: new versions
    (metrics rows, with the monotonic time each came) and each client's saved state (its mtime changes)."""

    def __init__(self, cfg: SoakConfig, work: Path, links: Links) -> None:
        self.cfg, self.work, self.links = cfg, work, links
        self.out, self.port = work / "out", free_port()
        (work / "tmp").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(work / "tmp")}
        self.server: ManagedProcess | None = None
        self.servers: list[ManagedProcess] = []
        self.clients: dict[int, ManagedProcess] = {}
        self.all: list[ManagedProcess] = []
        self.exit_codes: dict[str, int | None] = {}
        self.frozen: set[int] = set()
        self.rows: list[tuple[float, int]] = []  # (monotonic, version) per metrics row
        self.saves: dict[int, list[float]] = {i: [] for i in range(cfg.clients)}
        self._pos, self._mtimes = 0, {i: 0 for i in range(cfg.clients)}
        self.server_started = 0.0

    def state_dir(self, i: int) -> Path:
        return self.work / f"state{i}"

    def _start(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, [*self.links.prefix(), *argv], self.work / f"{name}.log", self.env, cwd=ROOT)
        self.all.append(proc)
        return proc

    def start_server(self, versions: int, resume: bool) -> None:
        argv = [*command("server_app.launcher", "flower-server"), "--insecure", "--port", str(self.port)]
        argv += ["--mode", "async", "--versions", str(versions), "--min-clients", str(self.cfg.clients)]
        argv += ["--task-timeout", f"{self.cfg.task_timeout:g}", "--compressor-options", "density=auto"]
        argv += ["--checkpoint-every", "1", "--database", str(self.out / "superlink.db"), "--quiet"]
        argv += ["--out", str(self.out), "--flwr-home", str(self.work / "server-home")]
        argv += ["-c", f"seed={self.cfg.seed}", "-c", "run-timeout=3600", "-c", "node-wait=900"]
        if resume:
            argv += ["--resume", str(self.out / "checkpoint.pt")]
        self.server = self._start(f"server{len(self.servers)}", argv)
        self.servers.append(self.server)
        self.server_started = time.monotonic()

    def start_client(self, i: int) -> None:
        argv = [*command("clients.launcher", "flower-client"), "--server", f"127.0.0.1:{self.port}", "--insecure"]
        argv += ["--partition-id", str(i), "--num-partitions", str(self.cfg.clients), "--device-class", "laptop"]
        argv += ["--flwr-home", str(self.work / f"client{i}-home"), "--state-dir", str(self.state_dir(i))]
        self.clients[i] = self._start(f"client{i}.{sum(p.name.startswith(f'client{i}.') for p in self.all)}", argv)

    def record_exit(self, proc: ManagedProcess) -> None:
        self.exit_codes[proc.name] = proc.poll()

    def worker_pids(self, i: int) -> list[int]:
        return [p for p in self.clients[i].remember_children() if "clients.worker" in command_line(p)]

    def freeze(self, i: int) -> list[int]:
        pids = tree(self.clients[i])
        self.frozen.update(pids)
        signal_pids(pids, signal.SIGSTOP)
        return pids

    def thaw(self, pids: list[int] | set[int]) -> None:
        signal_pids(list(pids), signal.SIGCONT)
        self.frozen.difference_update(pids)

    def checkpoint_version(self) -> int | None:
        import torch

        try:
            return int(torch.load(self.out / "checkpoint.pt", weights_only=True)["protocol"]["version"])
        except Exception:  # noqa: BLE001 - none yet, or being replaced
            return None

    def tick(self) -> None:
        """Remember every process's children, read new metrics rows and new client saves."""
        now = time.monotonic()
        for proc in self.all:
            if proc.poll() is None:
                proc.remember_children()
        metrics = self.out / "metrics.jsonl"
        if metrics.exists():
            with open(metrics, "rb") as f:
                f.seek(self._pos)
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    self._pos += len(line)
                    try:
                        self.rows.append((now, int(json.loads(line)["version"])))
                    except (ValueError, KeyError):
                        pass
        for i in self.saves:
            m = max((p.stat().st_mtime_ns for p in self.state_dir(i).rglob("*") if p.is_file()), default=0)
            if m > self._mtimes[i]:
                self._mtimes[i] = m
                self.saves[i].append(now)

    def versions_since(self, t: float) -> int:
        return sum(1 for when, _ in self.rows if when > t)

    def stop_all(self) -> None:
        """SIGCONT what is frozen, stop the clients then the servers (SIGTERM, SIGKILL after 8 s), then SIGKILL
        every process any of them was seen with."""
        self.thaw(set(self.frozen))
        for proc in reversed(self.all):
            if proc.poll() is None:
                proc.stop()
                self.record_exit(proc)
        signal_pids([pid for p in self.all for pid in p.known], signal.SIGKILL)


class Fault(ABC):
    """One kind of fault: ``targets`` it may hit now, ``inject`` starts it (returns how long it holds),
    ``finish`` ends it (a restart, a SIGCONT, the link back to normal)."""

    kind = ""

    @abstractmethod
    def targets(self, dep: Deployment) -> list[str]: ...

    @abstractmethod
    def inject(self, dep: Deployment, rng: random.Random, rec: FaultRecord) -> float: ...

    def finish(self, dep: Deployment, rec: FaultRecord) -> None:
        """Nothing to undo unless the kind says so."""


def _client(target: str) -> int:
    return int(target.removeprefix("client"))


def _live_clients(dep: Deployment) -> list[str]:
    return [f"client{i}" for i, p in sorted(dep.clients.items()) if p.poll() is None]


class ClientKill(Fault):
    kind = "client-kill"

    def targets(self, dep: Deployment) -> list[str]:
        return _live_clients(dep)

    def inject(self, dep: Deployment, rng: random.Random, rec: FaultRecord) -> float:
        proc = dep.clients[_client(rec.target)]
        kill_tree(proc)
        dep.record_exit(proc)
        return rng.uniform(1.0, 3.0)

    def finish(self, dep: Deployment, rec: FaultRecord) -> None:
        dep.start_client(_client(rec.target))


class WorkerKill(Fault):
    kind = "worker-kill"

    def targets(self, dep: Deployment) -> list[str]:
        return [t for t in _live_clients(dep) if dep.worker_pids(_client(t))]

    def inject(self, dep: Deployment, rng: random.Random, rec: FaultRecord) -> float:
        pids = dep.worker_pids(_client(rec.target))
        signal_pids(pids, signal.SIGKILL)
        rec.detail["pids"] = pids
        return 0.0


class ClientFreeze(Fault):
    kind = "client-freeze"

    def targets(self, dep: Deployment) -> list[str]:
        return _live_clients(dep)

    def inject(self, dep: Deployment, rng: random.Random, rec: FaultRecord) -> float:
        rec.detail["pids"] = dep.freeze(_client(rec.target))
        return rng.uniform(*dep.cfg.freeze_s)

    def finish(self, dep: Deployment, rec: FaultRecord) -> None:
        dep.thaw(rec.detail["pids"])


class ServerKill(Fault):
    """Only once the running server wrote a version (a server that never gets going proves nothing)."""

    kind = "server-kill"

    def targets(self, dep: Deployment) -> list[str]:
        ready = dep.server is not None and dep.server.poll() is None and dep.versions_since(dep.server_started) > 0
        return ["server"] if ready and dep.checkpoint_version() is not None else []

    def inject(self, dep: Deployment, rng: random.Random, rec: FaultRecord) -> float:
        assert dep.server is not None
        kill_tree(dep.server)
        dep.record_exit(dep.server)
        rec.detail["checkpoint_version"] = dep.checkpoint_version()
        rec.detail["rows_written"] = len(dep.rows)
        return 2.0

    def finish(self, dep: Deployment, rec: FaultRecord) -> None:
        dep.start_server(rec.detail.get("versions", 1_000_000), resume=True)


class SlowLink(Fault):
    kind = "slow-link"

    def targets(self, dep: Deployment) -> list[str]:
        return ["loopback"] if dep.links.available else []

    def inject(self, dep: Deployment, rng: random.Random, rec: FaultRecord) -> float:
        rec.detail["link"] = dep.links.degrade()
        return rng.uniform(*dep.cfg.freeze_s)

    def finish(self, dep: Deployment, rec: FaultRecord) -> None:
        dep.links.restore()


#: fault kind -> class; the soak draws kinds from a shuffled bag of these names.
FAULTS: dict[str, type[Fault]] = {f.kind: f for f in (ClientKill, WorkerKill, ClientFreeze, ServerKill, SlowLink)}


class Interrupted(Exception):
    pass


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


class Soak:
    """The fault phase, the finale (the last resume, with a target) and the check; ``run()`` returns the report.
    Every process is stopped and the namespace deleted in ``close()``, which ``run()`` always calls."""

    POLL_S, VERSION_BASE = 0.5, 1_000_000

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg, self.rng = cfg, random.Random(cfg.seed)
        self.work = Path(cfg.work) if cfg.work else Path(tempfile.mkdtemp(prefix="fedcomp-chaos-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.links = Links(cfg.links, cfg.slow_kbit, cfg.loss)
        self.dep = Deployment(cfg, self.work, self.links)
        self.kinds = [k for k in FAULTS if k != SlowLink.kind or self.links.available]
        self.faults: list[FaultRecord] = []
        self.events: list[str] = []
        self.bag: list[str] = []
        self.t0 = time.monotonic()
        self.hang = False

    def run(self) -> dict[str, Any]:
        load0 = os.getloadavg()
        try:
            self.dep.start_server(self.VERSION_BASE, resume=False)
            for i in range(self.cfg.clients):
                self.dep.start_client(i)
            self.chaos()
            self.finale()
        finally:
            self.close()
        return self.report(self.check(), load0)

    def close(self) -> None:
        self.dep.stop_all()
        self.links.close()

    def draw(self) -> tuple[Fault, str] | None:
        """The next kind from the shuffled bag that has a target now (one without goes to the back of the bag)."""
        for _ in range(2 * len(self.kinds)):
            if not self.bag:
                self.bag = list(self.kinds)
                self.rng.shuffle(self.bag)
            fault = FAULTS[self.bag.pop(0)]()
            targets = fault.targets(self.dep)
            if targets:
                return fault, self.rng.choice(targets)
            self.bag.append(fault.kind)
        return None

    def inject(self, fault: Fault, target: str, finale: bool = False) -> tuple[Fault, FaultRecord]:
        now = time.monotonic()
        rec = FaultRecord(fault.kind, target, round(now - self.t0, 1), finale=finale, started=now)
        rec.hold_s = round(fault.inject(self.dep, self.rng, rec), 1)
        rec.ends = now + rec.hold_s
        self.faults.append(rec)
        print(f"[{rec.at_s:7.1f}s] {fault.kind} {target}" + (f" for {rec.hold_s:.1f}s" if rec.hold_s else "")
              + (" (finale)" if finale else ""), flush=True)
        return fault, rec

    def done(self, now: float) -> bool:
        counts = {k: sum(f.kind == k and not f.finale for f in self.faults) for k in self.kinds}
        if now - self.t0 >= 2 * self.cfg.duration_s + 300:
            self.events.append(f"fault phase capped: kinds seen {counts}")
            return True
        return now - self.t0 >= self.cfg.duration_s and min(counts.values()) >= self.cfg.min_each

    def chaos(self) -> None:
        next_at = time.monotonic() + self.rng.uniform(*self.cfg.gap_s)
        active: tuple[Fault, FaultRecord] | None = None
        while True:
            self.step()
            now = time.monotonic()
            if active is not None and now >= active[1].ends:
                active[0].finish(self.dep, active[1])
                active, next_at = None, now + self.rng.uniform(*self.cfg.gap_s)
            if active is None and self.done(now):
                return
            if active is None and now >= next_at and (picked := self.draw()) is not None:
                active = self.inject(*picked)

    def step(self) -> None:
        """One tick: watch, and restart (with a note) a process that exited without a fault."""
        time.sleep(self.POLL_S)
        self.dep.tick()
        dep = self.dep
        if dep.server is not None and dep.server.poll() is not None and dep.server.name not in dep.exit_codes:
            dep.record_exit(dep.server)
            self.events.append(f"{dep.server.name} exited by itself with code {dep.server.poll()}; resumed")
            dep.start_server(self.VERSION_BASE, resume=(dep.out / "checkpoint.pt").exists())
        for i, proc in list(dep.clients.items()):
            if proc.poll() is not None and proc.name not in dep.exit_codes:
                dep.record_exit(proc)
                self.events.append(f"{proc.name} exited by itself with code {proc.poll()}; restarted")
                dep.start_client(i)

    def finale(self) -> None:
        """Kill the server once more and resume it with a target (checkpoint + tail); wait for it to exit."""
        fault = ServerKill()
        end = time.monotonic() + self.cfg.finish_s
        while not fault.targets(self.dep) and time.monotonic() < end:
            self.step()
        _, rec = self.inject(fault, "server", finale=True)
        rec.detail["versions"] = int(rec.detail.get("checkpoint_version") or 0) + self.cfg.tail
        time.sleep(rec.hold_s)
        fault.finish(self.dep, rec)
        server = self.dep.server
        assert server is not None
        end = time.monotonic() + self.cfg.finish_s
        while server.poll() is None and time.monotonic() < end:
            time.sleep(self.POLL_S)
            self.dep.tick()
        self.hang = server.poll() is None
        if self.hang:
            self.events.append(f"HANG: the last server did not finish within {self.cfg.finish_s:.0f}s")
        self.dep.record_exit(server)
        self.dep.tick()

    def check(self) -> tuple[int, dict[str, Any]]:
        """``fedcomp check OUT --client-state DIR ... --json``: its exit code and report."""
        argv = [*command("fedcomp.tools.cli", "fedcomp"), "check", str(self.dep.out), "--json"]
        for i in range(self.cfg.clients):
            argv += ["--client-state", str(self.dep.state_dir(i))]
        res = subprocess.run(argv, capture_output=True, text=True, env=self.dep.env, cwd=ROOT, timeout=600)
        try:
            return res.returncode, json.loads(res.stdout)
        except json.JSONDecodeError:
            return res.returncode, {"error": (res.stderr or res.stdout).strip()[-2000:]}

    def timings(self) -> float | None:
        """Fill each fault's ``next_version_s``, ``lost_s`` and ``back_s``; returns the median version interval."""
        times = [t for t, _ in self.dep.rows]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        median = statistics.median(gaps) if gaps else None
        for rec in self.faults:
            after = [t for t in times if t > rec.started]
            if after:
                rec.next_version_s = round(after[0] - rec.started, 1)
                rec.lost_s = round(max(0.0, rec.next_version_s - (median or 0.0)), 1)
            if rec.target.startswith("client"):
                saves = [t for t in self.dep.saves[_client(rec.target)] if t > rec.ends]
                rec.back_s = round(saves[0] - rec.ends, 1) if saves else None
        return median

    def report(self, checked: tuple[int, dict[str, Any]], load0: tuple[float, ...]) -> dict[str, Any]:
        code, rep = checked
        median = self.timings()
        run = (rep.get("runs") or [{}])[0]
        clients = rep.get("clients") or []
        twice = sum(max(0, c["server_applied"] - c["known_applied"]) for c in clients
                    if c.get("server_applied") is not None and c.get("known_applied") is not None)
        lost = sum(max(0, c.get("unaccounted") or 0) + c.get("stranded", 0) for c in clients) + sum(
            max(0, c["known_applied"] - c["server_applied"]) for c in clients
            if c.get("server_applied") is not None and c.get("known_applied") is not None)
        servers = [p.name for p in self.dep.servers]
        return {
            "config": {k: v for k, v in asdict(self.cfg).items() if k != "work"},
            "machine": {"cpus": os.cpu_count(), "load_start": [round(x, 2) for x in load0],
                        "load_end": [round(x, 2) for x in os.getloadavg()]},
            "links": {"shaped": self.links.available or any(f.kind == SlowLink.kind for f in self.faults),
                      "lossy": self.links.lossy, "why_not": self.links.why},
            "wall_s": round(time.monotonic() - self.t0, 1),
            "faults_by_kind": self.by_kind(),
            "faults": [{k: v for k, v in asdict(f).items() if k not in ("started", "ends")} for f in self.faults],
            "events": self.events,
            "versions": {"reached": run.get("versions"), "target": run.get("target_versions"),
                         "rows_written": len(self.dep.rows), "server_starts": len(servers),
                         "median_interval_s": None if median is None else round(median, 2)},
            "updates": {"applied": run.get("applied"), "nacked": run.get("nacked"), "duplicate": run.get("duplicate"),
                        "late": run.get("late"), "open_at_end": run.get("open_at_end"),
                        "clients": rep.get("client_totals"), "lost": lost, "applied_twice": twice},
            "check": {"exit_code": code, "verdict": rep.get("verdict", rep.get("error")),
                      "problems": rep.get("problems"), "notes": rep.get("notes")},
            "conserved": [bool((c.get("conservation") or {}).get("conserved")) for c in clients],
            "hang": self.hang,
            "exit_codes": {"last_server": self.dep.exit_codes.get(servers[-1]) if servers else None,
                           **self.dep.exit_codes},
            "work": str(self.work),
        }

    def by_kind(self) -> dict[str, dict[str, Any]]:
        out = {}
        last = self.dep.rows[-1][0] if self.dep.rows else 0.0
        for kind in self.kinds:
            recs = [f for f in self.faults if f.kind == kind]
            lost = [f.lost_s for f in recs if f.lost_s is not None]
            back = [f.back_s for f in recs if f.back_s is not None]
            out[kind] = {
                "count": len(recs),
                "survived": sum(f.started < last for f in recs),  # the run wrote a version after it
                "lost_s_median": round(statistics.median(lost), 1) if lost else None,
                "lost_s_max": max(lost, default=None),
                "back_s_median": round(statistics.median(back), 1) if back else None,
            }
        return out


def print_report(r: dict[str, Any]) -> None:
    from fedcomp.tools.report import table

    print("\nfaults by kind")
    print(table([{"kind": k, **v} for k, v in r["faults_by_kind"].items()]))
    u, v = r["updates"], r["versions"]
    print(f"\nversions {v['reached']}/{v['target']} ({v['rows_written']} rows, {v['server_starts']} server starts, "
          f"median {v['median_interval_s']} s between versions)")
    print(f"applied {u['applied']}  nacked {u['nacked']}  duplicate {u['duplicate']}  late {u['late']}  "
          f"open at end {u['open_at_end']}  lost {u['lost']}  applied twice {u['applied_twice']}")
    print(f"clients: {u['clients']}")
    print(f"links: {r['links']}")
    for e in r["events"]:
        print(f"event: {e}")
    print(f"fedcomp check: exit {r['check']['exit_code']}: {r['check']['verdict']}")
    print(f"exit codes: {r['exit_codes']}")
    print(f"load average {r['machine']['load_start']} -> {r['machine']['load_end']} on {r['machine']['cpus']} CPUs; "
          f"{r['wall_s']} s")


def parse(argv: list[str] | None = None) -> tuple[SoakConfig, argparse.Namespace]:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of faults (default 480)")
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--gap", type=float, nargs=2, default=d.gap_s, metavar=("MIN", "MAX"), help="seconds between faults")
    p.add_argument("--freeze", type=float, nargs=2, default=d.freeze_s, metavar=("MIN", "MAX"),
                   help="seconds a freeze or a slow link lasts")
    p.add_argument("--min-each", type=int, default=d.min_each, help="go on until every kind came this often")
    p.add_argument("--tail", type=int, default=d.tail, help="versions after the last resume")
    p.add_argument("--task-timeout", type=float, default=d.task_timeout)
    p.add_argument("--links", choices=("auto", "off"), default=d.links)
    p.add_argument("--slow-kbit", type=int, default=d.slow_kbit)
    p.add_argument("--loss", type=float, default=d.loss, help="random loss on a slow link where netem exists")
    p.add_argument("--finish", type=float, default=d.finish_s, help="seconds the last server may take (else: hang)")
    p.add_argument("--work", default="", help="folder for outputs, logs and state dirs (default: a new temp folder)")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    if a.clients < 3:
        p.error("--clients must be at least 3")
    cfg = SoakConfig(a.duration, a.clients, a.seed, tuple(a.gap), tuple(a.freeze), a.min_each, a.tail,
                     a.task_timeout, a.links, a.slow_kbit, a.loss, a.finish, a.work)
    return cfg, a


def ok(r: dict[str, Any]) -> bool:
    """The soak's goals: nothing lost or applied twice, check exit 0, the last server exit 0, no hang."""
    return (r["updates"]["lost"] == 0 and r["updates"]["applied_twice"] == 0 and r["check"]["exit_code"] == 0
            and r["exit_codes"]["last_server"] == 0 and not r["hang"])


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    soak = Soak(cfg)
    print(f"chaos soak in {soak.work}: {cfg.clients} clients, {cfg.duration_s:.0f}s of faults, kinds {soak.kinds}"
          + (f"; links: {soak.links.why}" if soak.links.why else ""), flush=True)
    try:
        report = soak.run()
    except Interrupted as exc:
        print(f"stopped by {exc}; every process stopped", file=sys.stderr)
        return 130
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
