"""A warm worker per node: the thin ``clients.app`` forwards tasks over a private channel to ``clients.worker``.

The worker runs as a real ``python -m clients.worker`` process (stopped by PID); the thin app is called in this
process as a ``flwr-clientapp`` would call it. Checked: the thin app imports no torch; forwarded tasks evolve the
session as in-process tasks do; a killed worker is replaced (``flower-client``'s ``WarmNode``) and its
successor continues from the state dir; a wrong key is refused; the channel's files are owner-only; without a
reachable worker the task runs in-process; the state dir wins over a stale ``context.state``; a worker busy with
another task is left alone and a hung one is killed. One slow test runs a real loopback deployment with warm
workers.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message, Metadata, RecordDict

from clients import channel
from clients.app import app
from clients.launcher import WarmNode, node_config, parser
from fedcomp.flower import records
from fedcomp.flower.session import STATE_KEY, ClientSession
from fedcomp.flower.statedir import STATE_FILE
from fedcomp.protocol import Outcome, Resolution, Task
from fedcomp.server.loops import encode_model
from fedcomp.spec import ModelSpec
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import make_model, node_partition

ROOT = Path(__file__).resolve().parents[1]
NODE_ID = 17
RUN = {"model": "mlp", "dataset": "digits", "local-steps": 2, "batch-size": 32, "compressor": "dgc+int8",
       "memory": "residual", "compressor-options": "density=0.05"}
HANG_S = 300  # bounds a hang only (a worker importing torch on a loaded 2-core machine), never times anything


def model_blob() -> bytes:
    run = RunConfig.from_flower(RUN)
    model = make_model(run, node_partition(run, NodeConfig(0, 2)))
    spec = ModelSpec.from_module(model)
    return encode_model(dict(model.named_parameters()), spec, 0)


def train_message(task_id: int, resolutions: list[Resolution], blob: bytes) -> Message:
    """The product loops' train message (``records.TaskFormat``: the model as ``blob``)."""
    run = RunConfig.from_flower(RUN)
    spec = ModelSpec.from_module(make_model(run, node_partition(run, NodeConfig(0, 2))))
    tasks = records.TaskFormat(run.compression.to_flat(), records.ArrayLayout.of_spec(spec))
    meta = Metadata(run_id=1, message_id=f"task-{task_id}", src_node_id=1, dst_node_id=NODE_ID,
                    reply_to_message_id="", group_id="0", created_at=time.time(), ttl=60.0,
                    message_type=records.TRAIN)
    task = Task(task_id, NODE_ID, 0, 0.0, 60.0, resolutions=resolutions)
    return Message(content=tasks.content(task, blob), metadata=meta)


def context(state_dir: Path | None, endpoint: channel.Endpoint | None = None) -> Context:
    node = {"partition-id": 0, "num-partitions": 2}
    if state_dir is not None:
        node["state-dir"] = str(state_dir)
    if endpoint is not None:
        node.update({channel.SOCKET_KEY: endpoint.socket, channel.KEY_KEY: endpoint.key_file,
                     channel.WAIT_KEY: endpoint.wait})
    return Context(1, NODE_ID, node, RecordDict(), dict(RUN))


def train(task_id: int, ctx: Context, blob: bytes, resolutions=()):
    """Blob, reply meta and the train function's metrics of one train task (``meta.pending``: the node's other
    updates still pending: a nack applied takes its update out)."""
    reply = app(train_message(task_id, list(resolutions), blob), ctx)
    assert reply.has_content(), reply.error
    return (*records.read_mod_reply(reply.content), dict(reply.content.metric_records["metrics"]))


def saved_session(state_dir: Path) -> ClientSession:
    run = RunConfig.from_flower(RUN)
    spec = ModelSpec.from_module(make_model(run, node_partition(run, NodeConfig(0, 2))))
    return ClientSession.from_bytes((state_dir / STATE_FILE).read_bytes(), run.compression, spec)


class Worker:
    """A ``python -m clients.worker`` process; ``stop`` / ``kill`` by PID."""

    def __init__(self, endpoint: channel.Endpoint, log: Path) -> None:
        argv = [sys.executable, "-m", "clients.worker", "--socket", endpoint.socket, "--key-file", endpoint.key_file]
        self.log = open(log, "ab")
        # the worker computes with this process's intra-op thread count: another one sums the loss (and may sum
        # gradients) in another order, and the comparisons with in-process tasks below are bit for bit
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=HANG_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


@pytest.fixture
def endpoint():
    """A private folder (short path: Unix socket paths are limited) with a key; the worker's socket in it."""
    folder = channel.private_dir(Path(tempfile.mkdtemp(prefix="fcw-")))
    channel.write_key(folder / "worker.key")
    yield channel.Endpoint(str(folder / "worker.sock"), str(folder / "worker.key"), wait=HANG_S)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def workers(tmp_path):
    started: list[Worker] = []

    def start(endpoint: channel.Endpoint) -> Worker:
        started.append(Worker(endpoint, tmp_path / f"worker{len(started)}.log"))
        return started[-1]

    yield start
    for w in started:
        w.stop()


def test_thin_app_imports_no_torch():
    code = "import sys, clients.app; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_forwarded_tasks_evolve_the_session_as_in_process_tasks_do(tmp_path, endpoint, workers):
    workers(endpoint)
    blob = model_blob()
    warm, cold = context(tmp_path / "warm", endpoint), context(tmp_path / "cold")
    got = {}
    for name, ctx in (("warm", warm), ("cold", cold)):
        first = train(1, ctx, blob)
        second = train(2, ctx, blob, [Resolution(1, 1, Outcome.LOST)])  # the nack restores update 1
        got[name] = (first, second)
    for name, (first, second) in got.items():
        assert (first[1].seq, second[1].seq) == (1, 2), name
        assert first[1].pending == () and second[1].pending == (), (name, second[1])  # the nack was applied
    for i in (0, 1):  # same residual, same compressor: byte for byte the same update
        assert got["warm"][i][0] == got["cold"][i][0], f"task {i + 1}: the worker sent another update"
        assert got["warm"][i][2]["train-loss"] == got["cold"][i][2]["train-loss"]
    assert saved_session(tmp_path / "warm").pipeline.last_seq == 2
    assert STATE_KEY not in warm.state  # with a worker and a state dir the session lives in the state dir
    assert STATE_KEY in cold.state


def test_a_killed_worker_is_replaced_and_continues_from_the_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    keeper = WarmNode(gpu=False, log=tmp_path / "worker.log", env=dict(os.environ), prestart=False)
    try:
        keeper.check()
        worker = keeper.worker
        endpoint = channel.Endpoint(str(keeper.socket), str(keeper.key_file), wait=HANG_S)
        state_dir, blob = tmp_path / "state", model_blob()
        _, meta1, _ = train(1, context(state_dir, endpoint), blob)
        first = worker.proc
        first.kill()  # between tasks
        end = time.monotonic() + HANG_S
        while worker.proc is None or worker.proc is first:
            keeper.check()
            assert time.monotonic() < end, "the worker was not restarted"
            time.sleep(0.1)
        # a fresh Context (empty context.state): all that carries over is the state dir
        _, meta2, _ = train(2, context(state_dir, endpoint), blob, [Resolution(1, 1, Outcome.LOST)])
    finally:
        keeper.stop()
    assert worker.starts == 2
    assert (meta1.seq, meta2.seq) == (1, 2) and meta2.incarnation == meta1.incarnation
    assert meta1.pending == () and meta2.pending == (), meta2  # update 1 was not lost: the nack found it
    assert not keeper.folder.exists()


def test_a_wrong_key_is_refused(tmp_path, endpoint, workers):
    workers(endpoint)
    other = Path(endpoint.key_file).with_name("other.key")
    channel.write_key(other)
    wrong = channel.Endpoint(endpoint.socket, str(other), wait=HANG_S)
    with pytest.raises(channel.Unreachable, match="refused the key"):
        channel.request(wrong, {"kind": "train"})
    with pytest.raises(channel.Unreachable, match="refused"):  # the right key, another protocol version
        channel.request(endpoint, {"protocol": channel.PROTOCOL + 1})
    _, meta, _ = train(1, context(tmp_path / "state", endpoint), model_blob())  # still serving
    assert meta.seq == 1


def test_the_channel_files_are_owner_only(endpoint, workers):
    workers(endpoint)
    channel.connect(endpoint).close()  # waits until the worker listens
    folder, sock, key = Path(endpoint.socket).parent, Path(endpoint.socket), Path(endpoint.key_file)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    key.chmod(0o644)
    with pytest.raises(PermissionError):
        channel.read_key(key)
    with pytest.raises(channel.Unreachable):  # the thin app will not use a key others can read
        channel.connect(endpoint)
    folder.chmod(0o755)
    with pytest.raises(PermissionError):
        channel.private_dir(folder)


def test_the_launcher_gives_a_warm_node_its_channel_and_a_state_dir():
    keeper = WarmNode(gpu=False, log=None, env={})
    try:
        args = parser().parse_args(["--server", "h:1"])
        text = node_config(args, keeper)
        assert f'worker-socket="{keeper.socket}"' in text and f'worker-key="{keeper.key_file}"' in text
        assert f'state-dir="{keeper.default_state_dir}"' in text
        assert stat.S_IMODE(keeper.folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(keeper.key_file.stat().st_mode) == 0o600
        assert args.worker == "warm"
        cold = parser().parse_args(["--server", "h:1", "--worker", "cold"])
        assert "worker" not in node_config(cold) and "state-dir" not in node_config(cold)
    finally:
        keeper.stop()


def test_without_a_reachable_worker_the_task_runs_in_process(tmp_path, endpoint):
    nobody = channel.Endpoint(endpoint.socket, endpoint.key_file, wait=0.5)  # no worker listens there
    _, meta, _ = train(1, context(tmp_path / "state", nobody), model_blob())
    assert meta.seq == 1 and meta.pending == ()
    assert saved_session(tmp_path / "state").pipeline.last_seq == 1


def test_a_task_with_a_deadline_of_months_is_served_warm(tmp_path, endpoint, workers):
    """A server may give a task any TTL (Flower's rule); one past what ``Connection.poll`` can wait (2**31 ms, about
    24.8 days) was an ``OverflowError`` in the forwarder after the worker took the task: a failed task each time,
    while the worker trained and kept the update pending."""
    workers(endpoint)
    blob, ctx = model_blob(), context(tmp_path / "state", endpoint)
    msg = train_message(1, [], blob)
    msg.metadata.ttl = 30 * 24 * 3600.0
    reply = app(msg, ctx)
    assert reply.has_content(), reply.error
    assert records.read_mod_reply(reply.content)[1].seq == 1
    assert STATE_KEY not in ctx.state  # the worker served it (in process, the session goes into context.state)


def test_the_state_dir_wins_over_a_stale_context_state(tmp_path, endpoint, workers):
    state_dir, blob = tmp_path / "state", model_blob()
    nobody = channel.Endpoint(endpoint.socket, endpoint.key_file, wait=0.5)
    ctx = context(state_dir, nobody)
    train(1, ctx, blob)  # in-process: the session goes into context.state and the state dir
    stale = ctx.state[STATE_KEY]
    workers(endpoint)
    _, meta2, _ = train(2, context(state_dir, endpoint), blob)  # the worker: the state dir only
    ctx.state[STATE_KEY] = stale
    _, meta3, _ = train(3, ctx, blob)  # in-process again, context.state one task behind
    assert (meta2.seq, meta3.seq) == (2, 3) and meta3.pending == (1, 2)


def test_a_task_answered_again_is_answered_with_its_first_update(tmp_path):
    """The reply to task 1 never left (a worker died after saving): task 1 again is answered with that update, the
    same bytes and seq, which stays pending until the server resolves it."""
    ctx, blob = context(tmp_path / "state"), model_blob()
    first, meta_first, _ = train(1, ctx, blob)
    again, meta, _ = train(1, context(tmp_path / "state"), blob)
    assert again == first and meta.seq == meta_first.seq == 1 and meta.pending == ()
    _, meta_next, _ = train(2, context(tmp_path / "state"), blob)
    assert meta_next.seq == 2 and meta_next.pending == (1,)  # still pending: its ack has not come


@pytest.mark.slow
def test_a_deployment_runs_on_warm_workers(tmp_path, started):
    """flower-server + two flower-clients (warm, the default) on loopback: the run completes, every task ran
    in a worker (no in-process fallback) from a forked ``flwr-clientapp`` (no cold start), and stopping a client
    stops its worker."""
    from test_deployment import finished, read_rows, start_deployment

    out = start_deployment(tmp_path, started, 4, 120)
    server, clients = started[0], started[1:]
    assert finished(server) == 0, server.tail(60)
    assert len(read_rows(out / "metrics.jsonl")) >= 4
    workers = []
    for c in clients:
        log = (tmp_path / f"{c.name}.log").read_text(errors="replace")
        assert "worker pid" in log and "in the ClientApp process" not in log, log[-3000:]
        assert "prestart: task process" in log and "fedcomp prestart:" not in log, log[-3000:]  # forked starts
        workers += [p for p in c.remember_children() if "clients.worker" in " ".join(_cmdline(p))]
    assert len(workers) == 2
    for c in clients:
        c.stop()
    end = time.monotonic() + HANG_S  # bounds a hang only; a worker normally exits within a second
    while any(_cmdline(p) for p in workers) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(_cmdline(p) for p in workers), "a worker outlived its flower-client"


def _cmdline(pid: int) -> list[str]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return [] if proc.status() == psutil.STATUS_ZOMBIE else proc.cmdline()
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def started():
    from fedcomp.tools.processes import signal_pids

    procs = []
    yield procs
    for p in reversed(procs):
        p.stop()
    signal_pids([pid for p in procs for pid in p.known], signal.SIGKILL)


def test_a_silent_peer_cannot_stall_the_worker(tmp_path, endpoint, workers):
    """A same-user process that connects and sends nothing is dropped after the handshake's deadline; the next
    task still runs in the worker (not in the ClientApp process after a long wait)."""
    import socket as socketlib

    workers(endpoint)
    channel.connect(endpoint).close()  # the worker listens
    silent = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    silent.connect(endpoint.socket)
    try:
        ctx = context(tmp_path / "state", channel.Endpoint(endpoint.socket, endpoint.key_file, wait=60.0))
        _, meta, _ = train(1, ctx, model_blob())
    finally:
        silent.close()
    assert meta.seq == 1 and STATE_KEY not in ctx.state  # ran in the worker: the session lives in the state dir


FAKE_WORKER = """
import sys, time
from clients import channel
listener = channel.WorkerListener(channel.Endpoint(sys.argv[1], sys.argv[2]))
print("listening", flush=True)
conn = listener.accept()
conn.recv()
time.sleep(600)  # takes the task, never answers
"""


def test_a_worker_that_takes_a_task_and_never_answers_is_killed(tmp_path, endpoint):
    proc = subprocess.Popen([sys.executable, "-c", FAKE_WORKER, endpoint.socket, endpoint.key_file], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "listening"
        with pytest.raises(channel.WorkerHung, match="killed"):
            channel.request(endpoint, {"kind": "train"}, timeout=2.0)
        assert proc.wait(timeout=HANG_S) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


BUSY_WORKER = """
import sys, time
from pathlib import Path
from clients import channel, worker

class Held:
    def handle(self, req):  # a task that trains until the test lets it end
        if req.get("hold"):
            print("holding", flush=True)
            while not Path(req["hold"]).exists():
                time.sleep(0.05)
        return {"content": "done", "state": {}}

listener = channel.WorkerListener(channel.Endpoint(sys.argv[1], sys.argv[2]))
print("listening", flush=True)
while True:
    worker.serve_one(listener, Held())  # the worker's own loop: one connection at a time
    print("served", flush=True)
"""


def wait_for(check, what: str):
    end = time.monotonic() + HANG_S
    while not check():
        assert time.monotonic() < end, f"no {what} within {HANG_S} s"
        time.sleep(0.05)


def test_a_busy_worker_is_left_alone_and_a_hung_one_is_killed(tmp_path, endpoint):
    """A second task that finds the worker busy with a long one (silent past ``worker-wait``) is refused as busy,
    for its ClientApp to run it in-process; the worker is not killed and the first task completes there. Once the
    worker has been waiting for connections and still does not answer (stopped), it is hung, and killed."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_WORKER, endpoint.socket, endpoint.key_file], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    release, replies = tmp_path / "release", {}

    def first() -> None:
        try:
            replies["first"] = channel.request(endpoint, {"hold": str(release)}, timeout=HANG_S)["content"]
        except Exception as exc:
            replies["first"] = repr(exc)

    held = threading.Thread(target=first)
    quick = channel.Endpoint(endpoint.socket, endpoint.key_file, wait=1.0)
    try:
        assert proc.stdout.readline().strip() == "listening"
        held.start()
        assert proc.stdout.readline().strip() == "holding"  # the first task runs in the worker
        with pytest.raises(channel.Unreachable, match="busy with another task"):
            channel.request(quick, {}, timeout=HANG_S)
        assert proc.poll() is None
        release.touch()
        held.join(HANG_S)
        assert replies == {"first": "done"} and proc.poll() is None
        lines = [proc.stdout.readline().strip() for _ in range(2)]  # the first task, the second's dropped connection
        assert lines == ["served", "served"]
        wait_for(lambda: (channel.worker_status(endpoint.socket) or (0, ""))[1] == channel.IDLE, "idle status")
        proc.send_signal(signal.SIGSTOP)  # waiting for connections, then frozen: hung
        with pytest.raises(channel.Unreachable, match="did not answer"):
            channel.request(quick, {}, timeout=HANG_S)
        assert proc.wait(timeout=HANG_S) == -signal.SIGKILL
    finally:
        release.touch()
        proc.kill()
        proc.wait()
        held.join(HANG_S)


def test_a_worker_busy_past_the_time_it_gave_is_hung(endpoint):
    """``known_hung`` from the status the worker's listener keeps: busy within its time is not hung, past it is;
    no status, or another process's, is not."""
    since = time.time()
    with channel.WorkerListener(endpoint) as listener:
        assert not channel.known_hung(endpoint.socket, os.getpid(), since)  # no status yet
        listener.busy(HANG_S)
        assert not channel.known_hung(endpoint.socket, os.getpid(), since)
        listener.busy(-1.0)
        assert channel.known_hung(endpoint.socket, os.getpid(), since)
        assert not channel.known_hung(endpoint.socket, os.getpid() + 1, since)
        assert not channel.known_hung(endpoint.socket, None, since)


def test_a_worker_that_stops_answering_is_killed_and_the_task_runs_anyway(tmp_path, endpoint, workers):
    state_dir, blob = tmp_path / "state", model_blob()
    worker = workers(endpoint)
    _, meta1, _ = train(1, context(state_dir, endpoint), blob)
    end = time.monotonic() + HANG_S  # back to waiting for connections (its status says so) before it freezes
    while (channel.worker_status(endpoint.socket) or (0, "", 0.0))[1] != channel.IDLE:
        assert time.monotonic() < end, channel.worker_status(endpoint.socket)
        time.sleep(0.05)
    worker.proc.send_signal(signal.SIGSTOP)  # frozen: its socket still accepts, it never answers
    ctx = context(state_dir, channel.Endpoint(endpoint.socket, endpoint.key_file, wait=3.0))
    _, meta2, _ = train(2, ctx, blob, [Resolution(1, 1, Outcome.LOST)])
    assert worker.proc.wait(timeout=HANG_S) == -signal.SIGKILL  # killed, for its launcher to restart
    assert (meta1.seq, meta2.seq) == (1, 2) and meta2.pending == ()  # nothing lost, in the ClientApp process


def test_the_worker_restarts_on_the_runs_code(tmp_path, endpoint, workers):
    """A request from an app whose code lives elsewhere (the run's FAB) is refused, and the worker replaces
    itself (same pid) with one running that code; the next request is served there."""
    fab = tmp_path / "fab"
    for package in ("clients", "fedcomp"):
        shutil.copytree(ROOT / package, fab / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", fab / "pyproject.toml")
    worker = workers(endpoint)
    with pytest.raises(channel.Restarting, match="restarting on it"):
        channel.request(endpoint, {"protocol": channel.PROTOCOL, "code": str(fab), "kind": "none"})
    end = time.monotonic() + HANG_S
    while True:  # a request that reaches the old socket while the worker restarts finds it gone: try again
        try:
            reply = channel.request(endpoint, {"protocol": channel.PROTOCOL, "code": str(fab), "kind": "none"})
            break
        except channel.Unreachable as exc:
            assert "restarting" not in str(exc) and time.monotonic() < end, exc
            time.sleep(0.2)
    assert "error" in reply  # served (a request that is not a ClientApp message is its error), not refused
    assert worker.proc.poll() is None
    log = Path(worker.log.name).read_text()
    assert f"(code: {fab})" in log and f"(code: {ROOT})" in log, log[-2000:]
    with pytest.raises(channel.Unreachable, match="has no pyproject.toml"):
        channel.request(endpoint, {"protocol": channel.PROTOCOL, "code": str(tmp_path), "kind": "none"})


def test_a_runs_first_task_is_served_warm_by_the_worker_restarted_on_its_code(tmp_path, endpoint, workers,
                                                                               monkeypatch):
    """The thin app of a run whose code (its FAB: the clients package, fedcomp installed beside) is elsewhere than
    the worker's: the worker refuses and restarts on it, and the app sends the task again to the new worker, so
    the task is served warm (its session lives in the state dir, not in the ClientApp's context.state)."""
    import clients.app as thin

    fab = tmp_path / "fab"
    shutil.copytree(ROOT / "clients", fab / "clients", ignore=shutil.ignore_patterns("__pycache__", "launcher.py",
                                                                                     "prestart.py"))
    shutil.copy(ROOT / "pyproject.toml", fab / "pyproject.toml")
    worker = workers(endpoint)
    monkeypatch.setattr(thin, "CODE_ROOT", str(fab))
    monkeypatch.setattr(thin, "_TASK", [])  # the forwarder is made for the code root of this process
    ctx = context(tmp_path / "state", endpoint)
    _, meta, _ = train(1, ctx, model_blob())
    assert meta.seq == 1 and STATE_KEY not in ctx.state  # ran in the worker
    assert worker.proc.poll() is None and f"(code: {fab})" in Path(worker.log.name).read_text()
