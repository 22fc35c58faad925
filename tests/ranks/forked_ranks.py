"""CPU test ranks forked from a process that has imported torch and DeepSpeed once, instead of a fresh interpreter
each (``tests/ranks/launch.run_local``).

A rank's start-up imports torch and DeepSpeed (about 5 CPU-seconds), then, on first use, torch._dynamo and
DeepSpeed's Muon module with torch._inductor (about 2 more), and one suite run on 2 cores starts about 180 of these
ranks. A *server* (``python -u -m tests.ranks.forked_ranks``, one per environment and test process, started on
first use) imports them once; each rank is then a fork of it that becomes what ``python -u script
--local_rank=<r> args`` would have been:

- its own session (``os.setsid``, so ``run_local`` stops it with ``killpg`` as before) before its pid is
  announced; stdout and stderr onto the rank's log file, stdin from /dev/null;
- the launch's environment and working directory, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them
  for a script; ``random`` and numpy's global generator reseeded as a fresh process seeds them;
- the start-up hook's per-launch actions applied again (``tests/ranks/cpu_hook/sitecustomize.apply_rank_hooks``);
- the script run as ``__main__`` (``runpy``); then, as the interpreter's exit does, the non-daemon threads joined,
  the ``atexit`` handlers run and the streams flushed; the exit status is the script's (``SystemExit``'s code, 1
  for an uncaught exception with its traceback on stderr), or minus the signal that killed it.

Only CPU ranks are forked (``ACCO_DS_TEST_HIDE_CUDA=1``), and only into a server whose environment equals the
launch's apart from the per-launch variables (the rank's place in the job, pytest's ``PYTEST_*`` (the current
test's name), and ``ACCO_DS_*`` switches that ``acco_ds``, never imported by the server, reads after the fork); any other launch starts a server of its own (at
most :data:`MAX_SERVERS` per test process, then fresh interpreters). ``ACCO_DS_TEST_FORK_RANKS=0`` turns it off:
every rank a fresh interpreter, as the DeepSpeed launcher starts them (its own tests always do).

Protocol (JSON lines): the client writes ``{"id", "argv", "env", "cwd", "log"}``; the server answers
``{"ready": true}`` once at start, ``{"id", "pid"}`` per fork and ``{"pid", "status"}`` when a rank exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading

SWITCH_ENV = "ACCO_DS_TEST_FORK_RANKS"
MAX_SERVERS = 3
START_TIMEOUT_S = 300.0
PER_LAUNCH = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
}
# read at the server's own start (before torch loads, or by the start-up hook): part of a server's identity
AT_START = {"ACCO_DS_TEST_HIDE_CUDA", "ACCO_DS_TEST_CPUINFO_CACHE"}


def server_env(env: dict) -> dict:
    """The part of a launch's environment that a server must share with it (``env`` without the per-launch
    variables)."""
    return {
        k: v
        for k, v in env.items()
        if k not in PER_LAUNCH
        and not k.startswith("PYTEST_")
        and (not k.startswith("ACCO_DS_") or k in AT_START)
    }


def enabled(env: dict) -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0" and env.get("ACCO_DS_TEST_HIDE_CUDA") == "1"


# ---------------------------------------------------------------- client (the test process)


class ForkedRank:
    """The ``subprocess.Popen`` surface ``run_local`` uses (``pid``, ``poll()``, ``returncode``) for a
    rank the server forked: its exit status comes from the server, its parent."""

    def __init__(self, server: Server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.status_of(self.pid)
        return self.returncode


class Server:
    """One server process and the thread that reads its answers."""

    def __init__(self, env: dict, cwd: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "tests.ranks.forked_ranks"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True,
        )  # fmt: skip
        self.lock, self.cond = threading.Lock(), threading.Condition()
        self.pids, self.statuses, self.ready, self.next_id = {}, {}, False, 0
        threading.Thread(target=self._read, daemon=True, name="forked-ranks-reader").start()
        with self.cond:
            if not self.cond.wait_for(lambda: self.ready or self.proc.poll() is not None, START_TIMEOUT_S):
                raise RuntimeError(f"the rank fork server did not start in {START_TIMEOUT_S:.0f} s")
        if not self.ready:
            raise RuntimeError(f"the rank fork server exited with status {self.proc.returncode} at start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if msg.get("ready"):
                    self.ready = True
                elif "id" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                else:
                    self.statuses[msg["pid"]] = msg["status"]
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def spawn(self, argv: list, env: dict, cwd: str, log: str) -> ForkedRank:
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            req = {"id": rid, "argv": argv, "env": env, "cwd": cwd, "log": log}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        with self.cond:
            if not self.cond.wait_for(lambda: rid in self.pids or self.proc.poll() is not None, 60.0):
                raise RuntimeError("the rank fork server did not fork in 60 s")
            if rid not in self.pids:
                raise RuntimeError(f"the rank fork server exited with status {self.proc.returncode}")
            return ForkedRank(self, self.pids.pop(rid))

    def status_of(self, pid: int):
        with self.cond:
            return self.statuses.pop(pid, None)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()


_SERVERS: dict = {}
_SERVERS_LOCK = threading.Lock()


def spawn(cmd: list, env: dict, cwd: str, log: str):
    """A ``ForkedRank`` for ``cmd`` (``[python, "-u", script, *args]``), or None when this launch is not forked
    (switched off, not a CPU rank, another interpreter or flags, or :data:`MAX_SERVERS` servers already)."""
    if not enabled(env) or cmd[0] != sys.executable or cmd[1] != "-u":
        return None
    key_env = server_env(env)
    key = json.dumps(key_env, sort_keys=True) + "\0" + cwd
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None:
            if len(_SERVERS) >= MAX_SERVERS:
                return None
            server = _SERVERS[key] = Server(key_env, cwd)
    return server.spawn([str(a) for a in cmd[2:]], env, cwd, log)


@atexit.register
def _close_servers() -> None:
    for server in list(_SERVERS.values()):
        server.close()
    _SERVERS.clear()


# ---------------------------------------------------------------- server


def _send(msg: dict) -> None:
    os.write(_OUT, (json.dumps(msg) + "\n").encode())


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _become_rank(req: dict, announced: int) -> None:
    """In the forked child: become the rank ``req`` describes, run it, exit. Never returns."""
    code = 1
    try:
        os.close(_OUT)
        os.setsid()
        os.write(announced, b"1")
        os.close(announced)
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        code = _run_rank(req)
    finally:
        os._exit(code)


def _run_rank(req: dict) -> int:
    import io
    import random
    import runpy
    import traceback

    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    hooks = getattr(sys.modules.get("sitecustomize"), "apply_rank_hooks", None)
    code = 0
    try:
        if hooks is not None:
            hooks()
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter: the traceback on stderr, status 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's exit waits for the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def _fork(req: dict) -> int:
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _become_rank(req, w)
    os.close(w)
    os.read(r, 1)  # the child is in its own session: killpg reaches it from now on
    os.close(r)
    return pid


def serve() -> None:
    import deepspeed  # noqa: F401
    import torch  # noqa: F401

    # torch._dynamo: what a rank imports on first use (the first torch.optim.Optimizer loads it), paid here once
    # instead of in every fork, and so is the Muon module below that DeepSpeed's ZeRO optimizer check imports
    # (its torch.compile decorators load torch._inductor): about 2 CPU-seconds a rank. Neither starts a thread
    # or a process (a fork copies only the thread that forks).
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    with contextlib.suppress(ImportError):
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    _send({"ready": True})
    children, buf = set(), b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05 if children else 1.0)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the test process is gone: so are its ranks
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = _fork(req)
                children.add(pid)
                _send({"id": req["id"], "pid": pid})
        while children:
            pid, raw = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send({"pid": pid, "status": _status(raw)})


if __name__ == "__main__":
    _OUT = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints of the imports stay off the answers
    serve()
