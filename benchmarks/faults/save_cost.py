"""What one checkpoint costs, to choose ``--save-every``: seconds per save and bytes per parameter on disk for
the 100M models of the memory benchmark (GPT-2 and Llama shapes, 14 layers x 768), ACCO in acco mode, 2 CPU
ranks, fp32 and bf16.

    python -m benchmarks.faults.save_cost                    # 4 runs, about 5 min on 2 cores
    python -m benchmarks.faults.save_cost --from-json benchmarks/results/faults/save_cost.json

Each case is ``acco-train --model ARCH --steps 3 --save-every 1`` (three saves, the figures are their median);
the seconds are the wall time of ``engine.save_checkpoint`` on rank 0 (every rank writes its shard at once),
the bytes every rank's files of one save (``acco_ds.cli.checkpoints.Saver``). Writes ``save_cost.md`` and
``save_cost.json`` into ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from acco_ds.cli.metrics import machine_info
from benchmarks.harness.cli import parser
from benchmarks.harness.records import results_dir
from benchmarks.memory.cli import SIZES

ROOT = Path(__file__).resolve().parents[2]


def parse(argv=None):
    ap = parser("faults.save_cost", __doc__)
    ap.add_argument("--archs", default="gpt2,llama")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--size", default="100m", choices=sorted(SIZES))
    ap.add_argument("--out", default=str(results_dir("faults")))
    ap.add_argument("--work", default=None)
    ap.add_argument("--from-json", default=None)
    return ap.parse_args(argv)


def run_case(arch: str, dtype: str, size: str, work: Path) -> dict:
    n_layer, d_model, n_head = SIZES[size]
    out = work / f"{arch}_{dtype}"
    cmd = [sys.executable, "-m", "acco_ds.train", "--model", arch, "--n-layer", str(n_layer), "--d-model",
           str(d_model), "--n-head", str(n_head), "--context", "64", "--micro-batch", "1", "--grad-accum", "2",
           "--steps", "3", "--save-every", "1", "--keep-checkpoints", "1", "--dtype", dtype, "--world-size", "2",
           "--mode", "acco", "--eval-windows", "2", "--warmup-steps", "1", "--no-progress", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"arch": arch, "dtype": dtype, "error": (proc.stdout + proc.stderr)[-3000:]}
    rank0 = json.loads((out / "runs" / "acco" / "rank0.json").read_text())
    params = json.loads((out / "summary.json").read_text())["model"]["params"]
    return {
        "arch": arch,
        "dtype": dtype,
        "size": size,
        "params": params,
        "world": 2,
        "save_s": rank0["save_s"],
        "bytes": rank0["checkpoint_bytes"],
        "wall_s": time.time() - t0,
    }


def render(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# What one ACCO checkpoint costs (choosing --save-every)",
        "",
        f"- Date: {res['date']}; machine: {m.get('cpu', '-')}, {m.get('cores', '-')} cores, local disk; "
        f"torch {m.get('torch', '-')}, deepspeed {m.get('deepspeed', '-')}",
        f"- Command: `{res['command']}`; raw results: the JSON beside this file",
        "- `acco-train --mode acco --world-size 2 --save-every 1 --steps 3`: the median of 3 saves on rank 0; bytes: "
        "every rank's files of one save (fp32 master weights and both Adam moments, sharded; the model's "
        "weights in their dtype; ACCO's in-flight state)",
        "",
        "| model | params | dtype | seconds per save (median of 3) | bytes on disk | bytes per parameter |",
        "|---|---|---|---|---|---|",
    ]
    for c in res["cases"]:
        if "error" in c:
            lines.append(f"| {c['arch']} | - | {c['dtype']} | failed | - | - |")
            continue
        s = statistics.median(c["save_s"])
        lines.append(
            f"| {c['arch']} {c['size']} | {c['params'] / 1e6:.1f}M | {c['dtype']} | {s:.2f} | "
            f"{c['bytes'] / 2**20:.0f} MiB | {c['bytes'] / c['params']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
    else:
        work = Path(a.work or tempfile.mkdtemp(prefix="acco_save_cost_"))
        cases = [
            run_case(arch, dt, a.size, work) for arch in a.archs.split(",") for dt in a.dtypes.split(",")
        ]
        res = {
            "machine": machine_info(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": " ".join(["python -m benchmarks.faults.save_cost", *(argv or sys.argv[1:])]),
            "cases": cases,
        }
        (out / "save_cost.json").write_text(json.dumps(res, indent=1) + "\n")
    text = render(res)
    (out / "save_cost.md").write_text(text)
    print(text)
    return 1 if any("error" in c for c in res["cases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
