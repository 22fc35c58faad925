"""A rank that dies (SIGKILL) or freezes (SIGSTOP) in the middle of a round: every other rank raises
an error naming the lost rank within comm_timeout_s + 4 heartbeat periods (+ slack for a loaded
machine) and exits, and no process is left behind (docs/RELIABILITY.md, "A rank that dies").

The ranks are started one process each with the env:// variables, as a multi-node launcher (or
the ranks of other nodes under ``deepspeed --hostfile``) would: the ``deepspeed`` launcher on one
node kills every local rank as soon as one exits, which would hide what ACCO does. That launcher
case is tested as well (the job ends, nothing left).

On a loaded 2-core machine nothing here hangs on a guessed delay: the test waits for the victim's
``ACCO_SIGNAL`` line and for the survivors' exits (each with a generous limit that only a hang reaches),
the ranks go in lockstep until the signal (tests/ranks/peer_loss_worker.py), and comm_timeout_s is 10 s,
so the heartbeat period is 1 s and a survivor is taken for lost only if it gets no CPU at all for 2 s
(at 3 s, 0.6 s of starvation was enough to name a survivor, or to time out a healthy round).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from acco_ds.core.liveness import heartbeat_interval
from tests.ranks.launch import REPO, deepspeed_cmd, free_port, rank_env

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORKER = REPO / "tests" / "ranks" / "peer_loss_worker.py"
WORLD = 3
TIMEOUT_S = 10.0  # optimizer.params.comm_timeout_s of the workers (heartbeat period: a tenth)
KILL_AT = 13  # micro-batch 13 = the second micro-batch of round 6 (GAS 4, acco: 2 per round)
# A survivor must raise the error naming the lost peer within the timeout, plus four heartbeat
# periods to name it, plus slack for a loaded 2-core CI box; and its process must be gone soon after
# (the interpreter's teardown, which a loaded machine stretches, is not ACCO's doing).
BOUND_S = TIMEOUT_S + 4 * heartbeat_interval(TIMEOUT_S) + 10.0
EXIT_LIMIT_S = 90.0
START_LIMIT_S = 300.0  # the ranks import torch/deepspeed and build the engine before the signal


def _tagged(tag: str) -> list:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if tag in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _left_behind(tag: str, within_s: float = 30.0) -> list:
    """The test's processes still alive after waiting up to ``within_s`` for them to end (a process that
    is being torn down when the test looks is not left behind; one still there after that is)."""
    _, alive = psutil.wait_procs(_tagged(tag), timeout=within_s)
    return alive


def _signal_time(log: Path) -> float | None:
    m = re.search(r"ACCO_SIGNAL (\d+\.\d+)", log.read_text(errors="replace")) if log.exists() else None
    return float(m.group(1)) if m else None


def _start_ranks(tmp: Path, tag: str, args: list) -> list:
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = rank_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=WORLD, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-u", str(WORKER), *map(str, args), "--timeout", str(TIMEOUT_S), "--tag", tag]
        with open(tmp / f"rank{r}.log", "w") as log:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def _logs(tmp: Path) -> str:
    return "\n".join(
        f"--- rank {r}:\n{(tmp / f'rank{r}.log').read_text(errors='replace')[-2500:]}" for r in range(WORLD)
    )


def _run_case(tmp: Path, victim: int, sig: str, extra: list) -> dict:
    """Start the ranks, wait for the victim's signal, then for every survivor's exit; returns per
    survivor (exit code, seconds from the signal to its exit and to its error, log text). A rank that
    ends before the signal fails the test at once, with the logs."""
    tag = f"acco-peer-loss-{uuid.uuid4().hex[:12]}"
    procs = _start_ranks(tmp, tag, ["--victim", victim, "--kill_at", KILL_AT, "--signal", sig, *extra])
    survivors = [r for r in range(WORLD) if r != victim]
    exits: dict = {}
    t_start = time.time()
    try:
        t_signal = None
        while True:
            now = time.time()
            if t_signal is None:
                early = [r for r in range(WORLD) if procs[r].poll() is not None]  # before reading the log
                t_signal = _signal_time(tmp / f"rank{victim}.log")
                assert t_signal is not None or not early, (
                    f"ranks {early} ended before the signal:\n{_logs(tmp)}"
                )
                assert now - t_start < START_LIMIT_S, f"the victim never reached its signal:\n{_logs(tmp)}"
            for r in survivors:
                if r not in exits and procs[r].poll() is not None:
                    exits[r] = now
            if len(exits) == len(survivors):
                break
            if t_signal is not None and now - t_signal > EXIT_LIMIT_S:
                break  # a survivor hangs: reported below, then killed
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the frozen victim, or a survivor that hangs (the test then fails)
            p.wait(timeout=30)
    assert t_signal is not None
    out = {}
    for r in survivors:
        text = (tmp / f"rank{r}.log").read_text(errors="replace")
        after = exits[r] - t_signal if r in exits else None
        m = re.search(r"ACCO_FAILED (\d+\.\d+)", text)
        raised = float(m.group(1)) - t_signal if m else None
        out[r] = {"rc": procs[r].returncode, "seconds": after, "raised": raised, "log": text}
    out["tag"] = tag
    return out


CASES = {
    # name: (victim, signal, extra worker args)
    "kill_rank2_acco": (2, "KILL", []),
    "kill_rank0_store_host": (0, "KILL", []),
    "kill_rank1_adaptive_dpu": (1, "KILL", ["--mode", "dpu", "--accumulation", "adaptive"]),
    "freeze_rank1_acco": (1, "STOP", []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_survivors_name_the_lost_rank_in_bounded_time(case, tmp_path):
    victim, sig, extra = CASES[case]
    res = _run_case(tmp_path, victim, sig, extra)
    for r in range(WORLD):
        if r == victim:
            continue
        info = res[r]
        tail = info["log"][-3000:]
        assert info["seconds"] is not None, (
            f"rank {r} still running {EXIT_LIMIT_S:.0f} s after the signal:\n{tail}"
        )
        assert info["raised"] is not None and info["raised"] <= BOUND_S, (
            f"rank {r} raised {info['raised']} s after the signal (> {BOUND_S:.1f} s):\n{tail}"
        )
        assert info["rc"] != 0, f"rank {r} exited with 0 although a peer was lost:\n{tail}"
        assert "ACCO_FAILED" in info["log"] and "ACCO_FINISHED" not in info["log"], tail
        assert re.search(rf"lost peer: rank {victim}\b", info["log"]), (
            f"rank {r} did not name rank {victim}:\n{tail}"
        )
        # what failed: a round's job, or (a fast adaptive rank already done) the end-of-run agreement
        what = r"communication job 'round \d+ \((peek|commit) of step \d+\)'|the agreement on the round count"
        assert re.search(what, info["log"]), tail
    left = _left_behind(res["tag"])
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def test_deepspeed_launcher_ends_the_whole_job(tmp_path):
    """Under ``deepspeed`` on one node, the launcher notices the killed rank (it polls every second)
    and terminates the others: the job ends within the bound and nothing is left."""
    tag = f"acco-peer-loss-{uuid.uuid4().hex[:12]}"
    cmd = deepspeed_cmd() + [
        "--num_gpus",
        str(WORLD),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(WORKER),
        *map(str, ["--victim", 1, "--kill_at", KILL_AT, "--timeout", TIMEOUT_S, "--tag", tag]),
    ]
    log = tmp_path / "launcher.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=rank_env(), stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            t0 = time.time()
            while _signal_time(log) is None and proc.poll() is None and time.time() - t0 < START_LIMIT_S:
                time.sleep(0.1)
            t_signal = _signal_time(log)
            assert t_signal is not None, log.read_text()[-3000:]
            rc = proc.wait(timeout=EXIT_LIMIT_S)
            took = time.time() - t_signal
            left = _left_behind(tag)  # the launcher is gone: its ranks must end too, by themselves
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for p in _tagged(tag):  # clean-up only (the test has failed then): the ranks this test started
                p.kill()
    assert rc != 0
    assert took <= EXIT_LIMIT_S, f"the launcher took {took:.1f} s to end the job"
    assert not left, f"processes left behind: {[(p.pid, p.info['cmdline']) for p in left]}"
