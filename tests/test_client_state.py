"""Client state belongs to one run and to one node: the server's run key travels with every task, a session of
another run is set aside (never mixed into the new one), the folder and its files are owner-only whoever made
them, every write has a temporary file of its own, a task holds the folder's session lock, and a second node on
the same folder stops at start."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from flwr.app import Context, Message, Metadata, RecordDict

from clients import task as product_task
from clients.app import app
from fedcomp.flower import records
from fedcomp.flower import statedir as statedir_mod
from fedcomp.flower.session import ClientSession
from fedcomp.flower.statedir import STATE_FILE, StateDir, StateDirInUse
from fedcomp.protocol import ProtocolConfig, Task
from fedcomp.server.checkpoint import atomic_write
from fedcomp.server.ledger import Ledger
from fedcomp.server.loops import encode_model
from fedcomp.spec import ModelSpec
from fedcomp.task.config import NodeConfig, RunConfig
from fedcomp.task.training import make_model, node_partition

ROOT = Path(__file__).resolve().parents[1]
RUN = {"model": "mlp", "dataset": "digits", "local-steps": 2, "batch-size": 32, "compressor": "dgc",
       "memory": "dgc", "compressor-options": "density=0.05 warmup_epochs=1"}
OTHER = {**RUN, "compressor": "dgc+int8", "memory": "residual", "compressor-options": "density=0.1"}
RUN_A, RUN_B, RUN_C = (1 << 61) | 11, (1 << 61) | 22, (1 << 61) | 33
HANG_S = 300


def blob(run_config: dict) -> bytes:
    run = RunConfig.from_flower(run_config)
    model = make_model(run, node_partition(run, NodeConfig(0, 2)))
    return encode_model(dict(model.named_parameters()), ModelSpec.from_module(model), 0)


def message(run_config: dict, task_id: int, run_key: int) -> Message:
    """The product loops' train message of task ``task_id`` of server run ``run_key``, to node 5."""
    run = RunConfig.from_flower(run_config)
    spec = ModelSpec.from_module(make_model(run, node_partition(run, NodeConfig(0, 2))))
    tasks = records.TaskFormat(run.compression.to_flat(), records.ArrayLayout.of_spec(spec))
    meta = Metadata(run_id=1, message_id=f"t{task_id}", src_node_id=1, dst_node_id=5, reply_to_message_id="",
                    group_id="0", created_at=time.time(), ttl=600.0, message_type=records.TRAIN)
    task = Task(task_id, 5, 0, 0.0, 600.0, run_key=run_key)
    return Message(content=tasks.content(task, blob(run_config)), metadata=meta)


def train(state_dir: Path, run_config: dict, task_id: int, run_key: int):
    """One in-process train task with a fresh Context (all that carries over is the state dir): blob, meta."""
    ctx = Context(1, 5, {"partition-id": 0, "num-partitions": 2, "state-dir": str(state_dir)}, RecordDict(),
                  dict(run_config))
    reply = app(message(run_config, task_id, run_key), ctx)
    assert reply.has_content(), reply.error
    return records.read_mod_reply(reply.content)


def saved(state_dir: Path, run_config: dict) -> ClientSession:
    run = RunConfig.from_flower(run_config)
    spec = ModelSpec.from_module(make_model(run, node_partition(run, NodeConfig(0, 2))))
    return ClientSession.from_bytes((state_dir / STATE_FILE).read_bytes(), run.compression, spec)


def test_a_new_run_starts_from_a_fresh_state_and_keeps_the_old_one_aside(tmp_path):
    state = tmp_path / "state"
    _, m1 = train(state, RUN, 1, RUN_A)
    _, m2 = train(state, RUN, 2, RUN_A)  # the same run (a resumed server keeps its key): continues
    assert (m1.seq, m2.seq) == (1, 2) and m2.incarnation == m1.incarnation
    assert saved(state, RUN).steps_done == 4
    # another run with other compression settings completes (it used to fail every task)
    _, m3 = train(state, OTHER, 1, RUN_B)
    assert m3.seq == 1 and m3.pending == () and m3.incarnation != m1.incarnation  # no update of run A pending
    aside = sorted(state.glob("client-state.run-*.pt"))
    assert [p.name for p in aside] == [f"client-state.run-{RUN_A:x}.pt"]
    # another run with the same settings starts afresh too: no old residual, warm-up from step 0, seq from 1
    _, m4 = train(state, OTHER, 1, RUN_C)
    assert m4.seq == 1 and m4.pending == ()
    now = saved(state, OTHER)
    assert now.run_key == RUN_C and now.steps_done == 2 and list(now.task_seqs) == [1]
    # run A's next task continues A's own session, set aside meanwhile: nothing of it was lost
    _, m5 = train(state, RUN, 3, RUN_A)
    assert (m5.seq, m5.pending, m5.incarnation) == (3, (1, 2), m1.incarnation)
    assert saved(state, RUN).run_key == RUN_A and saved(state, RUN).steps_done == 6


def test_beyond_the_bound_the_oldest_set_aside_session_is_removed_with_a_warning_naming_its_run(tmp_path,
                                                                                                monkeypatch):
    warned = []
    monkeypatch.setattr(statedir_mod, "log", lambda level, msg, *args: warned.append((level, msg % args)))
    folder = StateDir(tmp_path / "state")
    keys = [0xA0 + i for i in range(statedir_mod.KEEP_ASIDE + 2)]
    for i, key in enumerate(keys):  # run a0's session written first, a4's last
        folder.write(f"session of run {key:x}".encode())
        os.utime(folder.file, ns=(i * 10**9, i * 10**9))
        folder.set_aside(key)
    assert sorted(p.name for p in folder.path.glob("client-state.run-*.pt")) == [
        f"client-state.run-{k:x}.pt" for k in keys[2:]]
    assert [level for level, _ in warned] == [logging.WARNING] * 2
    assert "client state of run a0 " in warned[0][1] and "client state of run a1 " in warned[1][1]


def test_the_run_key_is_the_servers_and_survives_a_checkpoint():
    a, b = Ledger(ProtocolConfig()), Ledger(ProtocolConfig())
    assert a.run_key != b.run_key and (1 << 61) <= a.run_key < (1 << 62)
    task = a.dispatch(7, 0.0, 0, 0)
    assert task.run_key == a.run_key
    b.load_state_dict(a.state_dict())  # a resumed server
    assert b.run_key == a.run_key and b.dispatch(7, 1.0, 0, 0).run_key == a.run_key
    tasks = records.TaskFormat({}, records.ArrayLayout.of_spec(ModelSpec((("w", (2,)),))))
    assert records.read_mod_task(tasks.content(task, b"")).run_key == a.run_key
    legacy = {k: v for k, v in a.state_dict().items() if k != "run_key"}  # a checkpoint from before run keys
    c = Ledger(ProtocolConfig())
    c.load_state_dict(legacy)
    assert c.run_key == 0 and records.read_mod_task(tasks.content(c.dispatch(7, 2.0, 0, 0), b"")).run_key == 0


def test_a_run_resumed_from_a_checkpoint_before_run_keys_continues_its_clients_keyless_sessions(tmp_path):
    """Its clients saved keyless sessions (key 0); the resumed run stays keyless, so they continue (a new key set
    them aside and started afresh: seq 1, a new incarnation, the residual out of reach)."""
    state = tmp_path / "state"
    _, m1 = train(state, RUN, 1, 0)  # a server from before run keys: its tasks carry none
    resumed = Ledger(ProtocolConfig())
    resumed.load_state_dict({k: v for k, v in Ledger(ProtocolConfig()).state_dict().items() if k != "run_key"})
    _, m2 = train(state, RUN, 2, resumed.run_key)
    assert (m2.seq, m2.incarnation) == (2, m1.incarnation) and saved(state, RUN).steps_done == 4
    assert not list(state.glob("client-state.run-*"))  # nothing set aside


def test_state_dirs_and_files_are_owner_only_whoever_made_them(tmp_path):
    state = tmp_path / "given"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    (state / "notes.txt").write_text("x")
    os.chmod(state / "notes.txt", 0o644)
    train(state, RUN, 1, RUN_A)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / STATE_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "notes.txt").stat().st_mode) == 0o600
    assert not [p for p in state.iterdir() if p.name.endswith(".tmp")]


def test_a_symlink_planted_as_the_node_lock_is_refused_and_its_target_untouched(tmp_path):
    """A ``.node.lock`` symlink planted while the folder was open to others: claiming the folder used to truncate
    and write the pid through it, into a file of the node's user elsewhere."""
    precious = tmp_path / "notes.txt"
    precious.write_text("precious")
    state = tmp_path / "state"
    state.mkdir()
    (state / ".node.lock").symlink_to(precious)
    with pytest.raises(PermissionError, match=r"\.node\.lock, a symlink"):
        StateDir(state).claim()
    with pytest.raises(PermissionError, match="symlink"):
        train(state, RUN, 1, RUN_A)
    assert precious.read_text() == "precious"


def test_an_entry_that_is_no_file_or_folder_of_this_user_is_refused_before_anything_is_read(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / STATE_FILE)  # reading it would block for good
    with pytest.raises(PermissionError, match="client-state.pt, a special file"):
        StateDir(state).prepare()
    if os.getuid() == 0:  # a session file of another user, planted while the folder was open to others
        (state / STATE_FILE).unlink()
        (state / STATE_FILE).write_bytes(b"planted")
        os.chown(state / STATE_FILE, 4242, 4242)
        with pytest.raises(PermissionError, match="client-state.pt, a file of uid 4242"):
            train(state, RUN, 1, RUN_A)


@pytest.mark.parametrize("sticky", [False, True])
def test_a_state_dir_another_user_could_move_away_is_refused(tmp_path, sticky):
    """Under a folder every user may write without the sticky bit, another user could move the state dir away
    between two tasks; the next task made a fresh one and started afresh. Such a path is refused (with the sticky
    bit, as in /tmp, only the owner may move it)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777 if sticky else 0o777)
    state = shared / "node0" / "state"
    if sticky:
        assert StateDir(state).prepare().path.is_dir()
    else:
        with pytest.raises(PermissionError, match="writable by every user"):
            StateDir(state).prepare()
        assert not state.exists()


def _as_another_users(path, monkeypatch, link: bool = False) -> None:
    """``path`` becomes another user's: chowned to uid 4242 as root, else this process plays uid 4242."""
    if os.getuid() == 0:
        (os.lchown if link else os.chown)(path, 4242, 4242)
    else:
        monkeypatch.setattr(os, "getuid", lambda: 4242)


@pytest.mark.parametrize("case", ["owned-by-another", "group-writable", "symlink-of-another"])
def test_a_state_dir_under_a_folder_another_user_controls_is_refused(tmp_path, monkeypatch, case):
    """A folder above the state dir that another user owns (even sticky: its owner may move anything in it), that
    its group may write, or a symlink on the way that another user owns: that user could move the state dir away
    (the next task started afresh) or swap two nodes' (each continued the other's session). Refused, as OpenSSH's
    StrictModes refuses, before anything is made or read."""
    shared = tmp_path / "shared"
    shared.mkdir()
    state = shared / "state"
    if case == "owned-by-another":
        os.chmod(shared, 0o1777)
        _as_another_users(shared, monkeypatch)
        words = "belongs to uid"
    elif case == "group-writable":
        os.chmod(shared, 0o770)
        monkeypatch.setattr(os, "getgid", lambda: os.stat(shared).st_gid + 1)  # a group this user shares
        words = "writable by its group"
    else:
        real = tmp_path / "real"
        real.mkdir()
        shared.rmdir()
        shared.symlink_to(real)
        _as_another_users(shared, monkeypatch, link=True)
        words = "is a symlink of uid"
    with pytest.raises(PermissionError, match=words):
        StateDir(state).prepare()
    assert not os.path.lexists(state) and not (tmp_path / "real" / "state").exists()
    if case == "group-writable":
        os.chmod(shared, 0o1770)  # with the sticky bit only an entry's owner may move it
        assert StateDir(state).prepare().path.is_dir()


def test_a_group_writable_folder_of_the_users_own_group_is_kept(tmp_path, monkeypatch):
    """umask 002 with user-private groups (the user's primary group, no other member) makes folders group-writable
    that no one else may write: as Debian's sshd, such a folder is accepted; one whose group lists another member,
    or is another account's primary group (``nogroup`` is ``nobody``'s, ``_apt``'s, ...), is not."""
    import grp
    import pwd
    from types import SimpleNamespace

    from fedcomp.flower import statedir

    shared = tmp_path / "mine"
    shared.mkdir()
    os.chmod(shared, 0o775)
    gid = os.stat(shared).st_gid
    monkeypatch.setattr(os, "getgid", lambda: gid)
    members: list[str] = []
    monkeypatch.setattr(grp, "getgrgid", lambda gid: SimpleNamespace(gr_mem=members))
    accounts = [SimpleNamespace(pw_uid=os.getuid(), pw_gid=gid), SimpleNamespace(pw_uid=os.getuid() + 1,
                                                                                 pw_gid=gid + 1)]
    monkeypatch.setattr(pwd, "getpwall", lambda: accounts)
    statedir._another_accounts_group.cache_clear()  # the accounts are listed once per process
    assert StateDir(shared / "state").prepare().path.is_dir()
    accounts.append(SimpleNamespace(pw_uid=os.getuid() + 2, pw_gid=gid))  # another account's primary group
    statedir._another_accounts_group.cache_clear()
    with pytest.raises(PermissionError, match="writable by its group"):
        StateDir(shared / "state").prepare()
    statedir._another_accounts_group.cache_clear()
    accounts.pop()
    members.append("someone-else")
    with pytest.raises(PermissionError, match="writable by its group"):
        StateDir(shared / "state").prepare()


def test_a_symlink_of_another_user_in_the_state_dirs_place_is_refused(tmp_path, monkeypatch):
    """A symlink planted at the state dir's path: the node narrowed its target (the user's own folder) to 0700
    and wrote its lock into it. One of the node's own user (a chosen layout) still works."""
    mine = tmp_path / "www"
    mine.mkdir(mode=0o755)
    link = tmp_path / "state"
    link.symlink_to(mine)
    assert StateDir(link).prepare().path == link  # the user's own symlink
    os.chmod(mine, 0o755)
    if os.getuid() == 0:
        os.lchown(link, 4242, 4242)
    else:  # a link of this user seen as another's: this process plays another uid
        monkeypatch.setattr(os, "getuid", lambda: 4242)
    with pytest.raises(PermissionError, match="is a symlink of uid"):
        StateDir(link).prepare()
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755


def test_two_writers_never_share_a_temporary_file(tmp_path):
    """Writer 1 is half-way through its write when writer 2 writes the same file whole: both complete, and the
    file holds one of them whole (with one shared temporary name writer 1 wrote into writer 2's file, then
    failed)."""
    path = tmp_path / STATE_FILE
    first, second = b"1" * 4096, b"2" * 4096

    def slow_writer(f):
        f.write(first[:2048])
        atomic_write(path, second)  # the other writer, start to end
        f.write(first[2048:])

    atomic_write(path, slow_writer)
    assert path.read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]


def test_a_task_holds_the_session_lock(tmp_path, monkeypatch):
    state = tmp_path / "state"
    train(state, RUN, 1, RUN_A)
    held, release = threading.Event(), threading.Event()

    def other_task():
        with StateDir(state).session_lock():
            held.set()
            release.wait(HANG_S)

    t = threading.Thread(target=other_task)
    t.start()
    try:
        assert held.wait(HANG_S)
        monkeypatch.setattr(statedir_mod, "LOCK_WAIT", 0.5)
        with pytest.raises(StateDirInUse, match="another task held it"):
            with StateDir(state).session_lock(0.5):
                pass
        ctx = Context(1, 5, {"partition-id": 0, "num-partitions": 2, "state-dir": str(state)}, RecordDict(),
                      dict(RUN))
        with pytest.raises(StateDirInUse):  # the task waited for the lock, then failed: the state is untouched
            product_task.app(message(RUN, 2, RUN_A), ctx)
        assert saved(state, RUN).pipeline.last_seq == 1
    finally:
        release.set()
        t.join(HANG_S)
    _, m2 = train(state, RUN, 2, RUN_A)  # once free, the next task continues
    assert m2.seq == 2


def test_a_second_node_on_the_same_state_dir_stops_at_start(tmp_path):
    state = tmp_path / "state"
    claim = StateDir(state).claim()
    try:
        with pytest.raises(StateDirInUse, match=f"pid {os.getpid()}"):
            StateDir(state).claim()
        res = subprocess.run(
            [sys.executable, "-m", "clients.launcher", "--server", "127.0.0.1:1", "--insecure", "--worker", "cold",
             "--state-dir", str(state), "--max-retries", "0"],
            cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert res.returncode == 2 and "in use by another node" in res.stderr, res.stderr[-2000:]
    finally:
        claim.release()
    StateDir(state).claim().release()  # free again once released
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def test_a_session_that_served_no_run_yet_is_kept_and_takes_the_run(tmp_path):
    """A state made before any task (a simulator's seeded one, or a state from before run keys) is adopted, not
    set aside: its incarnation and residual stay."""
    run = RunConfig.from_flower(RUN)
    spec = ModelSpec.from_module(make_model(run, node_partition(run, NodeConfig(0, 2))))
    made = ClientSession.fresh(run.compression, spec)
    made.incarnation = 12345
    StateDir(tmp_path / "state").write(made.to_bytes())
    _, meta = train(tmp_path / "state", RUN, 1, RUN_A)
    assert meta.incarnation == 12345 and not list((tmp_path / "state").glob("client-state.run-*"))
    assert saved(tmp_path / "state", RUN).run_key == RUN_A
