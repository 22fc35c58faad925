"""tests/ranks/forked_ranks.py: a forked CPU rank is what ``python -u script --local_rank=<r> args`` started by
``run_local`` would have been: its arguments, environment, working directory, ``sys.path[0]``, output, session and
exit status, the non-daemon threads joined and the ``atexit`` handlers run before it exits; and it is a fork (the
server's imports, not its own), unless ``ACCO_DS_TEST_FORK_RANKS=0``."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import pytest

from tests.ranks import forked_ranks
from tests.ranks.launch import rank_env, run_local

pytestmark = pytest.mark.launcher

RANK = textwrap.dedent(
    """
    import atexit, json, os, sys, threading, time
    import torch
    out = sys.argv[sys.argv.index("--out") + 1]
    rank = int(os.environ["RANK"])
    facts = {
        "argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(), "rank": rank,
        "local_rank": os.environ["LOCAL_RANK"], "world": os.environ["WORLD_SIZE"],
        "switch": os.environ.get("ACCO_DS_TEST_EXAMPLE"), "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "cuda_hidden": os.environ.get("CUDA_VISIBLE_DEVICES") == "",
        "parent_is_server": "tests.ranks.forked_ranks" in open(f"/proc/{os.getppid()}/cmdline").read(),
        "main": __name__,
    }
    print(f"rank {rank} stdout", flush=True)
    print(f"rank {rank} stderr", file=sys.stderr)

    def late():
        time.sleep(0.5)
        with open(os.path.join(out, f"thread{rank}"), "w") as f:
            f.write("joined")

    threading.Thread(target=late).start()  # not a daemon: the exit waits for it
    atexit.register(lambda: open(os.path.join(out, f"atexit{rank}"), "w").write("ran"))
    with open(os.path.join(out, f"facts{rank}.json"), "w") as f:
        json.dump(facts, f)
    mode = sys.argv[sys.argv.index("--mode") + 1]
    if mode == "exit3" and rank == 1:
        sys.exit(3)
    if mode == "raise" and rank == 1:
        raise ValueError("planted")
    if mode == "hang" and rank == 1:
        time.sleep(600)
    """
)


def _launch(tmp_path, mode: str, check: bool = True, timeout: float = 120, **extra):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = rank_env(ACCO_DS_TEST_EXAMPLE="on", **extra)
    return run_local(script, 2, ["--out", out, "--mode", mode], env=env, check=check, timeout=timeout), out


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_rank_is_what_a_fresh_interpreter_would_be(tmp_path, monkeypatch, fork):
    monkeypatch.setenv(forked_ranks.SWITCH_ENV, fork)
    proc, out = _launch(tmp_path, "ok")
    assert proc.returncode == 0
    for r in range(2):
        facts = json.loads((out / f"facts{r}.json").read_text())
        assert facts["argv"] == [f"--local_rank={r}", "--out", str(out), "--mode", "ok"]
        assert facts["path0"] == str(tmp_path) and facts["main"] == "__main__"
        assert (facts["rank"], facts["local_rank"], facts["world"], facts["switch"]) == (r, str(r), "2", "on")
        assert facts["pgid_is_pid"] and facts["cuda_hidden"]
        assert facts["parent_is_server"] == (fork == "1")
        assert (out / f"thread{r}").read_text() == "joined" and (out / f"atexit{r}").read_text() == "ran"
        assert f"rank {r} stdout" in proc.stdout and f"rank {r} stderr" in proc.stdout


def test_exit_status_and_traceback_are_the_scripts(tmp_path):
    proc, _ = _launch(tmp_path, "exit3", check=False)
    assert proc.returncode == 3
    proc, _ = _launch(tmp_path, "raise", check=False)
    assert proc.returncode == 1 and "ValueError: planted" in proc.stdout


def test_a_hung_rank_is_stopped_through_its_session(tmp_path):
    """run_local's timeout stops the ranks with killpg: a forked rank is in a session of its own, so it ends."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish in 20 s"):
        _launch(tmp_path, "hang", timeout=20)
    assert time.monotonic() - start < 60


def test_servers_by_environment(tmp_path):
    """A launch whose environment differs beyond the per-launch variables gets a server of its own; the
    per-launch ones (the rank's place, the current test's name, ACCO_DS_* switches) share one."""
    env = rank_env()
    same = {
        **env,
        "RANK": "1",
        "ACCO_DS_TEST_EXAMPLE": "x",
        "PYTEST_CURRENT_TEST": "tests/other.py::t (call)",
    }
    assert forked_ranks.server_env(env) == forked_ranks.server_env(same)
    other = {**env, "PYTHONWARNINGS": "error"}
    assert forked_ranks.server_env(env) != forked_ranks.server_env(other)
    assert not forked_ranks.enabled({**env, "ACCO_DS_TEST_HIDE_CUDA": ""})  # GPU ranks start fresh


def test_the_server_kills_its_ranks_when_the_test_process_goes(tmp_path):
    env = rank_env()
    server = forked_ranks.Server(forked_ranks.server_env(env), str(tmp_path))
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    log = tmp_path / "log"
    log.write_text("")
    rank = server.spawn([str(script)], env, str(tmp_path), str(log))
    assert rank.poll() is None
    server.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(rank.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(rank.pid, signal.SIGKILL)
        pytest.fail("the rank outlived its server")
