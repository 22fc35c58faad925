"""``python -m acco_ds.run`` / ``acco-run``: run an unmodified training script with ACCO registered.

DeepSpeed has no plugin mechanism for optimizer types: ``"optimizer": {"type": "ACCO"}`` works only in a
process that imported ``acco_ds`` first. ``python -m acco_ds.run SCRIPT [args...]`` (or ``-m MODULE
[args...]``) imports acco_ds, which registers "ACCO" with DeepSpeed, and then runs the script as
``__main__``, as ``python SCRIPT [args...]`` (``python -m MODULE [args...]``) would, so a script that takes
``--deepspeed ds_config.json`` (the Hugging Face example scripts) trains with ACCO unchanged, under any
launcher::

    deepspeed --num_gpus 8 --module acco_ds.run train.py --deepspeed acco.json ...
    torchrun --nproc-per-node 8 -m acco_ds.run train.py --deepspeed acco.json ...
    accelerate launch --config_file accelerate.yaml -m acco_ds.run train.py ...

Contract (what the script sees is what ``python SCRIPT`` gives it):

- ``__name__`` is ``"__main__"`` and the script's module stays ``sys.modules["__main__"]``; ``__file__`` is
  its absolute path; ``sys.argv`` is ``[SCRIPT, args...]``, SCRIPT as typed. ``sys.path[0]`` is the script's
  folder, symbolic links resolved, in place of the entry this runner was started from (with ``python -P`` /
  ``PYTHONSAFEPATH``: nothing). ``-m MODULE`` runs it with ``runpy.run_module(alter_sys=True)``, as
  ``python -m`` does: ``sys.argv[0]`` the module's file, ``sys.path[0]`` the current directory; a folder
  or zip with ``__main__.py`` runs with ``runpy.run_path``.
- The options before SCRIPT are this runner's: ``-m MODULE`` and ``-h``/``--help``, and ``--local_rank=N``
  (also ``--local_rank N``, ``--local-rank[=]N``), which the ``deepspeed`` launcher puts before the target
  of ``--module``: it is moved right after SCRIPT, where ``deepspeed SCRIPT`` puts it, so the script's own
  parser gets it. Everything after SCRIPT is the script's, untouched; the environment is not changed.
- The exit status is the script's: 0 when it returns, its ``sys.exit`` code, 1 for an uncaught exception,
  whose traceback (through ``sys.excepthook``, also setting ``sys.last_value`` as the interpreter does)
  starts at the script's own frame, without this runner's. A KeyboardInterrupt is left to the interpreter.
- Bad input (no SCRIPT, a file that does not exist, a module that cannot be found, an unknown option before
  SCRIPT): a message naming what is wrong and the usage on stderr, exit status 2; the script does not run.

Importing this module runs nothing and changes nothing beyond what importing the package does (``import
acco_ds`` registers ACCO): only ``main()`` changes ``sys.argv``, ``sys.path`` and ``sys.modules["__main__"]``
and runs the script.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import runpy
import sys
import types
import zipfile
from dataclasses import dataclass, field
from typing import List

USAGE = (
    "usage: python -m acco_ds.run [--local_rank=N] SCRIPT [args...]\n"
    "       python -m acco_ds.run [--local_rank=N] -m MODULE [args...]\n"
    "       (acco-run is the same command)"
)
HELP = (
    USAGE + "\n\nRuns SCRIPT (or MODULE) as __main__ with its own arguments after importing acco_ds, which "
    'registers the DeepSpeed optimizer type "ACCO":\n'
    "  deepspeed --num_gpus N --module acco_ds.run train.py --deepspeed acco.json ...\n"
    "  torchrun --nproc-per-node N -m acco_ds.run train.py --deepspeed acco.json ...\n"
    "  accelerate launch --config_file accelerate.yaml -m acco_ds.run train.py ...\n"
)
_LOCAL_RANK = ("--local_rank", "--local-rank")


class UsageError(ValueError):
    """The runner's own arguments are wrong (exit status 2)."""


@dataclass
class Target:
    """What to run: ``kind`` "path" (a script, a folder or zip with ``__main__.py``) or "module", its
    ``name``, and the argv the script gets after its own name (``--local_rank`` first when one was moved)."""

    kind: str
    name: str
    args: List[str] = field(default_factory=list)


def parse(argv: List[str]) -> Target | None:
    """The target of ``argv`` (the runner's arguments, without the program name); None for ``--help``.
    Raises UsageError for anything else before the script."""
    moved: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            return None
        if arg.split("=", 1)[0] in _LOCAL_RANK:
            if "=" in arg:
                moved.append(arg)
                i += 1
            elif i + 1 < len(argv):
                moved += argv[i : i + 2]
                i += 2
            else:
                raise UsageError(f"{arg} needs a value")
            continue
        if arg == "-m":
            if i + 1 >= len(argv):
                raise UsageError("-m needs a module name")
            return Target("module", argv[i + 1], moved + argv[i + 2 :])
        if arg.startswith("-m") and len(arg) > 2:  # -mMODULE, as python accepts it
            return Target("module", arg[2:], moved + argv[i + 1 :])
        if arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r} before the script (the script's options go after it)")
        return Target("path", arg, moved + argv[i + 1 :])
    raise UsageError("no script given")


def _find_module(name: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:
        raise UsageError(f"no module named {name!r} ({err})") from None
    if found is None:
        raise UsageError(f"no module named {name!r}")


def _runner_frames() -> set:
    """Code file names of the frames between ``main()`` and the script: this module's and runpy's."""
    return {__file__, runpy.__file__, runpy._run_code.__code__.co_filename}


def _report_uncaught(exc: BaseException) -> None:
    """Print ``exc`` as the interpreter prints an uncaught exception, its traceback starting at the script."""
    tb = exc.__traceback__
    runner = _runner_frames()
    while tb is not None and tb.tb_frame.f_code.co_filename in runner:
        tb = tb.tb_next
    tb = tb if tb is not None else exc.__traceback__  # raised by runpy itself: keep everything
    exc = exc.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    sys.excepthook(type(exc), exc, tb)


def _prepare(target: Target) -> None:
    """Check the target and set ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT`` / ``python -m MODULE``
    would. Raises UsageError when the target does not exist."""
    safe_path = getattr(sys.flags, "safe_path", False)
    if target.kind == "module":
        if not safe_path:
            sys.path[0] = os.getcwd()
        _find_module(target.name)  # with the current directory on sys.path, where python -m looks
    elif not os.path.exists(target.name):
        raise UsageError(f"can't open file {target.name!r}: no such file or directory")
    elif not safe_path:
        if os.path.isfile(target.name) and not zipfile.is_zipfile(target.name):
            sys.path[0] = os.path.dirname(os.path.realpath(target.name))
        else:  # a folder or zip with __main__.py: run_path puts it first on sys.path itself
            del sys.path[0]
    sys.argv = [target.name, *target.args]  # -m: run_module makes argv[0] the module's file, as python -m


def _run(target: Target) -> None:
    if target.kind == "module":
        runpy.run_module(target.name, run_name="__main__", alter_sys=True)
    elif os.path.isfile(target.name) and not zipfile.is_zipfile(target.name):
        _run_source_file(target.name)
    else:
        runpy.run_path(target.name, run_name="__main__")


def _run_source_file(path: str) -> None:
    """Execute ``path`` as ``python path`` does: in a new module ``__main__`` that stays ``sys.modules["__main__"]``
    (pickle and multiprocessing find the script's classes there, also after it returns), ``__file__`` and
    the code's file name absolute, none of this module's ``__future__`` flags. (``runpy.run_path`` would set
    ``sys.argv[0]`` and ``__file__`` both to the path as typed and restore the previous ``__main__``.)"""
    filename = os.path.abspath(path)
    with io.open_code(filename) as f:
        code = compile(f.read(), filename, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=filename,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", filename),
        __spec__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def main(argv: List[str] | None = None) -> int:
    """Run the target of ``argv`` (default ``sys.argv[1:]``) with ACCO registered; returns the exit status
    (0: the script returned; 1: it raised; 2: bad input). A ``sys.exit`` in the script propagates as
    SystemExit."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "acco_ds.run"
    try:
        target = parse(argv)
        if target is None:
            print(HELP)
            return 0
        _prepare(target)
    except UsageError as err:
        print(f"{prog}: error: {err}\n{USAGE}", file=sys.stderr)
        return 2

    import acco_ds

    try:
        acco_ds.register()
    except ImportError as err:
        print(f"{prog}: error: cannot register ACCO with DeepSpeed: {err}", file=sys.stderr)
        return 1
    try:
        _run(target)
    except Exception as exc:  # reported as the interpreter reports an uncaught exception
        _report_uncaught(exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
