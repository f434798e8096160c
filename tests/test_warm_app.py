"""Warm nodes for any ClientApp (``flower-client --app``): a plain Flower app served from the node's worker.

The app is ``tests/warmapp`` (a folder laid out as an installed FAB: ``pyproject.toml`` naming
``counting_app:app``), whose module keeps a call counter and a model object. The forwarder (``clients.forward``)
is called in this process as a forked ``flwr-clientapp`` calls it; the worker is a real ``python -m
clients.worker`` process (stopped by PID). Checked: Flower's import of the FAB's clientapp module gets the
forwarder and never runs the user's module there (nor imports torch); the worker restarts on the FAB's code and
its app object lives across messages (counter, model id, pid); the reply is the app's; ``context.state``,
``node_config`` and ``run_config`` behave as in Flower; raising and error replies come back as such; with no
worker the task runs in-process on the real module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict
from test_worker import HANG_S, ROOT, endpoint, workers  # noqa: F401  (fixtures)

from clients import channel
from clients.forward import FabFinder, WarmApp

FAB = ROOT / "tests" / "warmapp"
REF = "counting_app:app"
NODE_ID = 23


def message(x: float, **flags: bool) -> Message:
    meta = Metadata(run_id=5, message_id=f"m{x}", src_node_id=1, dst_node_id=NODE_ID, reply_to_message_id="",
                    group_id="0", created_at=time.time(), ttl=120.0, message_type="train")
    return Message(content=RecordDict({"config": ConfigRecord({"x": x, **flags})}), metadata=meta)


def context(ep: channel.Endpoint | None) -> Context:
    node: dict = {"partition-id": 3, "num-partitions": 4}
    if ep is not None:
        node.update({channel.SOCKET_KEY: ep.socket, channel.KEY_KEY: ep.key_file, channel.WAIT_KEY: ep.wait})
    return Context(5, NODE_ID, node, RecordDict(), {"greeting": "hi"})


def metrics(reply: Message) -> dict:
    assert reply.has_content(), reply.error
    return dict(reply.content.metric_records["metrics"])


def test_flowers_import_of_the_fabs_clientapp_gets_the_forwarder():
    """In a fresh process, as in a forked flwr-clientapp: Flower's loader, the FAB's folder first on the path."""
    code = (
        "import sys\n"
        "from clients.forward import FabFinder, WarmApp\n"
        "sys.meta_path.insert(0, FabFinder('fab'))\n"
        "from flwr.clientapp.utils import get_load_client_app_fn\n"
        "from flwr.supercore.object_ref import load_app\n"
        f"app = load_app({REF!r}, RuntimeError, {str(FAB)!r})\n"
        "assert isinstance(app, WarmApp), type(app)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(app.code, app.ref)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [str(FAB), REF]
    assert "counting_app imported" not in res.stdout + res.stderr  # the user's module never ran there


def test_the_finder_passes_other_imports_and_other_folders():
    finder = FabFinder("fab")
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(FAB))
        assert finder.find_spec("json") is None and finder.find_spec("counting_app") is not None
        sys.path[0] = str(ROOT / "tests")  # a folder without a Flower app
        assert finder.find_spec("counting_app") is None
    finally:
        sys.path[:] = saved
    named = FabFinder("other_module:client")  # --app module:attr: that app is served, the FAB's module stood in for
    sys.path.insert(0, str(FAB))
    try:
        spec = named.find_spec("counting_app")
    finally:
        sys.path[:] = saved
    assert spec.loader.app.ref == "other_module:client" and spec.loader.attr == "app"


def test_the_worker_keeps_the_users_app_across_messages(endpoint, workers):  # noqa: F811
    """Two train messages through the forwarder: the worker restarted on the FAB's code served both with one
    app object (counter 1 then 2, one pid and model id, the model moved twice), the reply is the app's own, and
    context.state, node_config and run_config follow Flower's semantics."""
    worker = workers(endpoint)
    forwarder = WarmApp(str(FAB), REF)
    ctx = context(endpoint)
    first = forwarder(message(1.5), ctx)
    second_reply = forwarder(message(4.0), ctx)
    one, two = metrics(first), metrics(second_reply)
    assert (one["calls"], two["calls"]) == (1, 2)  # module-level state lived across tasks
    assert one["pid"] == two["pid"] == worker.proc.pid != os.getpid()  # in the worker (restarted in place)
    assert one["model-id"] == two["model-id"] and two["weight"] == pytest.approx(one["weight"] + 1.0)
    assert (one["x2"], two["x2"]) == (3.0, 8.0) and one["partition"] == 3
    assert (one["state-count"], two["state-count"]) == (1, 2)  # context.state came back and went in again
    assert ctx.state.config_records["counter"]["n"] == 2
    echo = second_reply.content.config_records["echo"]
    assert echo["greeting"] == "hi" and echo["type"] == "train"
    assert "arrays" in second_reply.content.array_records
    assert second_reply.metadata.reply_to_message_id == "m4.0" and second_reply.metadata.dst_node_id == 1
    log = Path(worker.log.name).read_text()
    assert f"(code: {FAB})" in log and log.count("counting_app imported") == 1, log[-2000:]


def test_raising_and_error_replies_come_back_as_such(endpoint, workers):  # noqa: F811
    workers(endpoint)
    forwarder, ctx = WarmApp(str(FAB), REF), context(endpoint)
    with pytest.raises(ValueError, match="asked to fail"):
        forwarder(message(1.0, fail=True), ctx)
    reply = forwarder(message(1.0, error=True), ctx)
    assert reply.has_error() and reply.error.code == 7 and "error reply" in reply.error.reason
    assert metrics(forwarder(message(2.0), ctx))["calls"] == 1  # the worker lives on


def test_without_a_worker_the_real_app_runs_in_process():
    saved = list(sys.path)
    try:
        reply = WarmApp(str(FAB), REF)(message(2.0), context(None))
    finally:
        sys.path[:] = saved
        sys.modules.pop("counting_app", None)
    got = metrics(reply)
    assert got["pid"] == os.getpid() and got["x2"] == 4.0 and got["calls"] == 1


@pytest.mark.slow
def test_a_deployment_serves_the_users_app_from_the_warm_worker(tmp_path):
    """A real SuperLink, ``flower-client --app fab`` and ``flwr run`` of the test app: its three train messages
    were all answered by one process that kept the app object (counter 1, 2, 3; one pid, one model id), from
    forked ``flwr-clientapp`` starts, with no in-process fallback."""
    import json

    from fedcomp.tools.processes import (
        ManagedProcess,
        flower_env,
        free_port,
        run_info,
        signal_pids,
        submit_run,
        superlink_argv,
        wait_http_ready,
        write_flower_config,
        write_overrides,
    )

    port, out, procs = free_port(), tmp_path / "rows.json", []
    env = {**flower_env(tmp_path / "link-home"), "PYTHONPATH": str(ROOT)}
    write_flower_config(tmp_path / "user-home", "local", f"127.0.0.1:{port}")
    try:
        link = ManagedProcess("superlink", superlink_argv(port, extra=["--insecure"]), tmp_path / "link.log", env)
        procs.append(link)
        wait_http_ready(f"127.0.0.1:{port}", HANG_S, link)
        argv = [sys.executable, "-m", "clients.launcher", "--server", f"127.0.0.1:{port}", "--insecure", "--app",
                "fab", "--partition-id", "3", "--num-partitions", "4", "--flwr-home", str(tmp_path / "node-home"),
                "--log", str(tmp_path / "node.log")]
        procs.append(ManagedProcess("client", argv, tmp_path / "node.out", env, ROOT))
        user = {**env, "FLWR_HOME": str(tmp_path / "user-home")}
        run_id = submit_run(FAB, "local", user, write_overrides(tmp_path / "o.toml", {"out": str(out)}))
        end, status = time.monotonic() + HANG_S, ""
        while not status.startswith("finished") and time.monotonic() < end:
            for p in procs:
                p.remember_children()
            time.sleep(1.0)
            status = run_info("local", run_id, user)["status"]
    finally:
        for p in reversed(procs):
            p.stop()
        signal_pids([pid for p in procs for pid in p.known], 9)
    log = (tmp_path / "node.log").read_text(errors="replace")
    assert status == "finished:completed", (status, log[-3000:])
    rows = json.loads(out.read_text())
    assert [r["calls"] for r in rows] == [1, 2, 3] and [r["state-count"] for r in rows] == [1, 2, 3]
    assert len({r["pid"] for r in rows}) == 1 and len({r["model-id"] for r in rows}) == 1
    assert [r["x2"] for r in rows] == [0.0, 2.0, 4.0] and rows[0]["partition"] == 3
    assert log.count("prestart: task process") >= 3 and "in the ClientApp process" not in log, log[-3000:]
    assert "restarting on the run's code" in log, log[-3000:]
