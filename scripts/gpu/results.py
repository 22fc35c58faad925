"""The GPU runs' results in benchmarks/results/gpu_checks: which commit each run ran, which steps it ran and which
of its tests passed; the run's manifest (run.json) on the GPU machine; a returned run's folder imported here.

    python scripts/gpu/results.py manifest RUN_DIR start BUDGET_S   # run.json: name, device, date, commit, tree
    python scripts/gpu/results.py manifest RUN_DIR end EXIT_STATUS  # ... and the end
    python scripts/gpu/results.py import RETURNED_RUN_DIR [DEST_ROOT] # unpacks details.tar.gz into DEST_ROOT/NAME
    python scripts/gpu/results.py list                              # every run, its commit and its test files

A run is a folder with a run.json (written by scripts/gpu/checks.sh), or an entry of legacy_runs.json (the runs
made before). :func:`file_outcomes` says, per GPU test file, how many tests ran, passed, failed or were skipped,
and whether the file ran completely: for a run.json run, when the tests its step collected (collected_STEP.txt)
all have a result; for a legacy run, when its step ended ok or a later test file of the same JUnit suite has
results (pytest runs the files in order), or the JUnit file is named in the entry's ``complete_junit``.
No torch import.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_checks"
STEP_LINE = __import__("re").compile(r"^=== (\w+): (ok|FAILED|TIMEOUT|SKIPPED)\b.*?(?:\((\d+)s\))?$")
RESULT_WORD = {"ok": "ok", "FAILED": "failed", "TIMEOUT": "timeout", "SKIPPED": "skipped"}


@dataclass
class Run:
    name: str
    device: str
    date: str
    commit: str
    command: str = ""
    tree: str = ""
    folder: Path | None = None  # a run.json run's folder
    files: dict = field(default_factory=dict)  # log, summary, junit (list), kernels, overlap: absolute paths
    complete_junit: tuple = ()
    steps: list = field(default_factory=list)  # [(name, limit or None, result, seconds)]
    collected: dict | None = None  # {step: [node ids]}: run.json runs only

    def step_result(self, name: str):
        for n, _, result, _ in self.steps:
            if n == name:
                return result
        return None


def _git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def steps_from_log(path: Path) -> list:
    """[(name, None, result, seconds)] from the '=== name: RESULT (Ns)' lines of a gpu_checks.log."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = STEP_LINE.match(line)
        if m:
            out.append((m.group(1), None, RESULT_WORD[m.group(2)], int(m.group(3) or 0)))
    return out


def steps_from_tsv(path: Path) -> list:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            name, limit, result, _rc, seconds = line.split("\t")
            out.append((name, int(limit), result, int(seconds)))
    return out


def load_run_folder(folder: Path) -> Run:
    meta = json.loads((folder / "run.json").read_text())
    files = {"junit": sorted(folder.glob("junit_*.xml"))}
    for key, name in (("log", "gpu_checks.log"), ("summary", "summary.md"), ("kernels", "kernels_cuda.json"),
                      ("overlap", "gpu_overlap.json")):  # fmt: skip
        if (folder / name).is_file():
            files[key] = folder / name
    collected = {p.name[len("collected_"):-len(".txt")]: p.read_text().split()
                 for p in folder.glob("collected_*.txt")}  # fmt: skip
    steps = steps_from_tsv(folder / "steps.tsv") if (folder / "steps.tsv").is_file() else []
    return Run(meta["name"], meta.get("device", "?"), meta.get("date", "?"), meta.get("commit", "?"),
               meta.get("command", ""), meta.get("tree", ""), folder, files, (), steps, collected)  # fmt: skip


def load_runs(results: Path = RESULTS) -> list:
    """Every run under ``results``: the legacy index's entries, then the run.json folders, by date then name."""
    runs = []
    legacy = results / "legacy_runs.json"
    if legacy.is_file():
        for e in json.loads(legacy.read_text())["runs"]:
            files = {k: (results / v).resolve() for k, v in e["files"].items() if k != "junit"}
            files["junit"] = [(results / j).resolve() for j in e["files"].get("junit", [])]
            run = Run(e["name"], e["device"], e["date"], e["commit"], e.get("command", ""), e.get("tree", ""),
                      None, files, tuple((results / j).resolve() for j in e.get("complete_junit", ())))  # fmt: skip
            if "log" in files and files["log"].is_file():
                run.steps = steps_from_log(files["log"])
            runs.append(run)
    for meta in sorted(results.glob("*/run.json")):
        runs.append(load_run_folder(meta.parent))
    return sorted(runs, key=lambda r: (r.date, r.name))


def _suites(path: Path):
    root = ET.parse(path).getroot()
    return [root] if root.tag == "testsuite" else root.findall("testsuite")


def _test_file(classname: str) -> str | None:
    return classname.replace(".", "/") + ".py" if classname.startswith("tests.") else None


def _blank() -> dict:
    return {"ran": 0, "passed": 0, "failed": 0, "skipped": 0, "collected": None, "complete": False}


def _junit_outcomes(run: Run, path: Path) -> dict:
    """{test file: outcome} of one JUnit file; for a legacy run, a file is complete when its step ended (ok or
    failed, not stopped), when a later file of the same suite has results, or when the entry says so."""
    out: dict = {}
    for suite in _suites(path):
        order = []
        for tc in suite.iter("testcase"):
            f = _test_file(tc.get("classname") or "")
            if f is None:
                continue
            o = out.setdefault(f, _blank())
            if f not in order:
                order.append(f)
            o["ran"] += 1
            if tc.find("failure") is not None or tc.find("error") is not None:
                o["failed"] += 1
            elif tc.find("skipped") is not None:
                o["skipped"] += 1
            else:
                o["passed"] += 1
        if run.collected is None:
            ended = run.step_result(suite.get("name")) in ("ok", "failed") or path in run.complete_junit
            for i, f in enumerate(order):
                out[f]["complete"] = ended or i < len(order) - 1
    return out


def file_outcomes(run: Run) -> dict:
    """{test file: {"ran", "passed", "failed", "skipped", "collected" (None where not recorded), "complete"}}.
    Where several JUnit files of a run hold one test file (a legacy rerun of part of it), the last that ran it
    completely counts, else the last; their counts are never added."""
    out: dict = {}
    for path in run.files.get("junit", []):
        if Path(path).is_file():
            for f, o in _junit_outcomes(run, Path(path)).items():
                if o["complete"] or not out.get(f, {}).get("complete"):
                    out[f] = o
    if run.collected is not None:
        counts: dict = {}
        for ids in run.collected.values():
            for node in ids:
                f = node.split("::", 1)[0]
                counts[f] = counts.get(f, 0) + 1
        for f, n in counts.items():
            o = out.setdefault(f, _blank())
            o["collected"] = n
            o["complete"] = o["ran"] == n
    return out


def passed_files(run: Run) -> set:
    """The test files every test of which passed in this run, the file run completely."""
    return {f for f, o in file_outcomes(run).items()
            if o["complete"] and o["ran"] > 0 and o["passed"] == o["ran"]}  # fmt: skip


def _device_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "no GPU"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "no GPU"


def manifest(run_dir: Path, phase: str, value: str) -> dict:
    """run.json in ``run_dir``: at ``start`` the run's name, device, UTC date, commit, the tree's changes against
    it (``git status --porcelain``: a run of a dirty tree says so), the budget and the selection; at ``end`` the
    exit status and the end time added."""
    path = run_dir / "run.json"
    now = datetime.now(timezone.utc)
    if phase == "start":
        try:
            commit, dirty = _git("rev-parse", "--short=7", "HEAD"), _git("status", "--porcelain").splitlines()
        except (OSError, subprocess.CalledProcessError):
            commit, dirty = "nogit", []
        meta = {"name": run_dir.name, "device": _device_name(), "date": now.strftime("%Y-%m-%d"),
                "start": now.isoformat(timespec="seconds"), "commit": commit,
                "tree": commit + (f" with {len(dirty)} uncommitted paths (dirty)" if dirty else ""),
                "dirty": dirty, "budget_s": int(value),
                "command": " ".join([*(f"{k}={os.environ[k]!r}" for k in
                                       ("GPU_CHECKS_ONLY", "GPU_CHECKS_ORDER", "GPU_CHECKS_SERIAL",
                                        "GPU_CHECKS_BUDGET_S", "BENCH_KERNELS_ARGS", "BENCH_OVERLAP_ARGS")
                                       if os.environ.get(k)), "bash scripts/gpu/checks.sh"])}  # fmt: skip
    else:
        meta = json.loads(path.read_text())
        meta.update(end=now.isoformat(timespec="seconds"), exit_status=int(value))
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def import_run(src: Path, dest_root: Path = RESULTS) -> Path:
    """Copy a returned run folder (gpu_checks.log, summary.md, details.tar.gz) to DEST_ROOT/NAME with the tar
    unpacked; refuses when DEST_ROOT/NAME exists (a run never goes over another's) or a member would leave it."""
    dest = dest_root / src.name
    if dest.exists():
        raise FileExistsError(f"{dest} exists: a run never goes over another run's folder")
    tmp = dest_root / f".{src.name}.importing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in src.iterdir():
        if p.name != "details.tar.gz" and p.is_file():
            shutil.copy2(p, tmp / p.name)
    tar = src / "details.tar.gz"
    if tar.is_file():
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                if not m.isfile() or "/" in m.name or m.name.startswith("."):
                    raise ValueError(f"{tar}: unexpected member {m.name!r}")
            # the members are checked above; the "data" filter where this Python has it (3.11.4+, 3.12)
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            t.extractall(tmp, **kw)
    if not (tmp / "run.json").is_file():
        shutil.rmtree(tmp)
        raise FileNotFoundError(
            f"{src}: no run.json (in details.tar.gz or beside it): not a scripts/gpu/checks.sh run"
        )
    tmp.rename(dest)
    return dest


def main(argv) -> int:
    if len(argv) == 4 and argv[0] == "manifest" and argv[2] in ("start", "end"):
        manifest(Path(argv[1]), argv[2], argv[3])
        return 0
    if len(argv) in (2, 3) and argv[0] == "import":
        print(import_run(Path(argv[1]), Path(argv[2]) if len(argv) == 3 else RESULTS))
        return 0
    if argv == ["list"]:
        for r in load_runs():
            print(f"{r.name}  {r.device}  commit {r.commit}  ({r.tree})")
            for f, o in sorted(file_outcomes(r).items()):
                n = "?" if o["collected"] is None else o["collected"]
                print(f"   {f}: {o['passed']}/{o['ran']} passed, collected {n}, "
                      f"{'complete' if o['complete'] else 'INCOMPLETE'}")  # fmt: skip
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
