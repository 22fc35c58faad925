"""``python -m acco_ds.run`` (acco_ds/run.py) gives a script what ``python SCRIPT`` gives it, with ACCO
registered: the same argv, ``sys.path[0]``, ``__file__``, ``__main__`` and compile flags (checked against the
same probe script run by plain ``python``), ``--local_rank`` moved where ``deepspeed SCRIPT`` puts it, the
script's exit status and its own traceback; bad input exits 2 with a message; importing the module runs
nothing. No launcher: the runs under deepspeed, torchrun and accelerate are tests/integrations/
test_unmodified_scripts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acco_ds import run as acco_run

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import atexit, json, os, sys


def fail():
    raise RuntimeError("the probe fails on purpose")


def seen():
    engine = sys.modules.get("deepspeed.runtime.engine")
    def f(x: int): ...
    return {
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd_on_path": os.getcwd() in sys.path or "" in sys.path,
        "file": __file__,
        "main_is_this": sys.modules["__main__"].__dict__ is globals(),
        "annotations_evaluated": f.__annotations__["x"] is int,
        "acco_registered": bool(engine and getattr(engine.DeepSpeedEngine, "_acco_ds_patched", False)),
    }


atexit.register(lambda: print("last_value:", repr(getattr(sys, "last_value", None)), flush=True))
if __name__ == "__main__":
    print(json.dumps(seen()), flush=True)
    if "--fail" in sys.argv:
        fail()
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
"""
RAISE_LINE = PROBE.splitlines().index('    raise RuntimeError("the probe fails on purpose")') + 1


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A work folder (the subprocesses' cwd) with the probe in ``src/``, reached through a link in ``bin/``
    (``sys.path[0]`` is the folder of the file, links resolved), and a package ``pkg`` holding it as a module."""
    root = tmp_path_factory.mktemp("run")
    (root / "src").mkdir()
    (root / "src" / "probe.py").write_text(PROBE)
    (root / "bin").mkdir()
    (root / "bin" / "train.py").symlink_to(root / "src" / "probe.py")
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "probe.py").write_text(PROBE)
    return root


def python(cwd: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def seen(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


def last_value(proc: subprocess.CompletedProcess) -> str:
    return next(line for line in proc.stdout.splitlines() if line.startswith("last_value:"))


def traceback_of(stderr: str) -> str:
    return stderr[stderr.index("Traceback (most recent call last):") :]


def test_script_sees_what_python_gives_it_with_local_rank_moved(tree):
    """``deepspeed --module acco_ds.run bin/train.py a --b`` runs ``python -m acco_ds.run --local_rank=1
    bin/train.py a --b``; the script must see what ``deepspeed bin/train.py a --b`` gives it: ``python
    bin/train.py --local_rank=1 a --b``."""
    plain = python(tree, "bin/train.py", "--local_rank=1", "a", "--b")
    ours = python(tree, "-m", "acco_ds.run", "--local_rank=1", "bin/train.py", "a", "--b")
    assert plain.returncode == 0 and ours.returncode == 0, ours.stderr
    want, got = seen(plain), seen(ours)
    assert want["acco_registered"] is False and got.pop("acco_registered") is True
    want.pop("acco_registered")
    assert got == want
    assert got["argv"] == ["bin/train.py", "--local_rank=1", "a", "--b"]
    assert got["path0"] == str(tree / "src") and not got["cwd_on_path"]
    assert got["file"] == str(tree / "bin" / "train.py") and got["main_is_this"]


def test_module_sees_what_python_m_gives_it(tree):
    plain = python(tree, "-m", "pkg.probe", "--local_rank=0", "x")
    ours = python(tree, "-m", "acco_ds.run", "--local_rank=0", "-m", "pkg.probe", "x")
    assert plain.returncode == 0 and ours.returncode == 0, ours.stderr
    want, got = seen(plain), seen(ours)
    want.pop("acco_registered")
    assert got.pop("acco_registered") is True
    assert got == want
    assert got["argv"] == [str(tree / "pkg" / "probe.py"), "--local_rank=0", "x"]
    assert got["path0"] == str(tree) and got["name"] == "__main__"


def test_exit_status_of_sys_exit(tree):
    assert python(tree, "-m", "acco_ds.run", "src/probe.py", "--exit", "3").returncode == 3


def test_uncaught_exception_exits_1_with_the_scripts_own_traceback(tree):
    """The traceback is the one ``python SCRIPT`` prints (the script's frames only, no runner or runpy frame),
    and ``sys.last_value`` is set for the exit handlers as the interpreter sets it."""
    plain = python(tree, "src/probe.py", "--fail")
    ours = python(tree, "-m", "acco_ds.run", "src/probe.py", "--fail")
    assert plain.returncode == ours.returncode == 1
    assert traceback_of(ours.stderr) == traceback_of(plain.stderr)
    shown = traceback_of(ours.stderr)
    assert f'File "{tree / "src" / "probe.py"}", line {RAISE_LINE}, in fail' in shown
    assert "runpy" not in shown and "acco_ds" not in shown
    assert last_value(ours) == last_value(plain) == "last_value: RuntimeError('the probe fails on purpose')"


def test_acco_run_command(tree):
    """The console script ``acco-run`` (pyproject.toml) runs a module as ``python -m`` does: from the current
    directory, which replaces the console script's own folder (the environment's bin) on sys.path."""
    exe = Path(sys.executable).parent / "acco-run"
    if not exe.exists():
        pytest.skip(f"{exe} is not installed (pip install -e . creates it)")
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [str(exe), "--local_rank", "0", "-m", "pkg.probe", "y"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    got = seen(proc)
    assert (
        got["argv"] == [str(tree / "pkg" / "probe.py"), "--local_rank", "0", "y"] and got["acco_registered"]
    )
    assert got["path0"] == str(tree) and got["name"] == "__main__"


def test_missing_script_exits_2_with_usage(tree):
    proc = python(tree, "-m", "acco_ds.run", "nosuch.py", "--x")
    assert proc.returncode == 2
    assert "can't open file 'nosuch.py'" in proc.stderr and "usage: python -m acco_ds.run" in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no script given"),
        (["--foo", "train.py"], "unknown option '--foo' before the script"),
        (["--local_rank"], "--local_rank needs a value"),
        (["-m"], "-m needs a module name"),
        (["-m", "no_such_module_anywhere"], "no module named 'no_such_module_anywhere'"),
        (["missing/train.py"], "can't open file 'missing/train.py'"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert acco_run.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and acco_run.USAGE in err


@pytest.mark.parametrize(
    "argv, kind, name, args",
    [
        (["t.py", "--local_rank=2", "a"], "path", "t.py", ["--local_rank=2", "a"]),  # the script's own: kept
        (["--local_rank=2", "t.py", "a"], "path", "t.py", ["--local_rank=2", "a"]),
        (["--local_rank", "2", "t.py", "a"], "path", "t.py", ["--local_rank", "2", "a"]),
        (["--local-rank=2", "t.py"], "path", "t.py", ["--local-rank=2"]),
        (["--local_rank=1", "-m", "pkg.mod", "-x"], "module", "pkg.mod", ["--local_rank=1", "-x"]),
        (["-mpkg.mod", "--help"], "module", "pkg.mod", ["--help"]),
        (["t.py", "-m", "x", "--help"], "path", "t.py", ["-m", "x", "--help"]),
    ],
)
def test_parse(argv, kind, name, args):
    assert acco_run.parse(argv) == acco_run.Target(kind, name, args)


def test_help_exits_0(capsys):
    assert acco_run.main(["--help"]) == 0
    assert "deepspeed --num_gpus N --module acco_ds.run train.py" in capsys.readouterr().out


def test_import_alone_runs_nothing(tree):
    """``import acco_ds.run`` with a script on the command line: nothing runs, sys.argv and sys.path stay."""
    code = (
        "import sys; argv, path = list(sys.argv), list(sys.path); import acco_ds.run; "
        "print('unchanged' if (sys.argv, sys.path) == (argv, path) else 'changed')"
    )
    proc = python(tree, "-c", code, "src/probe.py", "--exit", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["unchanged"]
