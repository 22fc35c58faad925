"""Resuming from the committed state kept in node memory (``optimizer.params.memory_state``, docs/RELIABILITY.md
"A crashed process"), ranks started as DeepSpeed's per-node launcher starts them, on CPU (the worker:
tests/ranks/memory_state_worker.py).

Two ranks train sync, dpu and acco in fp32, acco in bf16, acco in fp16 with overflows (the loss scaler moves),
acco with int8 rounds, and acco and dpu in fp16 on the paths only a GPU rank takes (the CUDA executor on emulated
streams, each job's host summary read one job late), recording every step in memory and saving a disk checkpoint
at step ``SAVE``, then stop without cleaning up, as a crashed process does. Then:

- on the same 2 ranks (a crashed process restarted on its live node), each resumes from memory at step ``SAVE``
  with the fp32 master and both moments bit for bit those of the save;
- on 3 ranks, each resumes from memory and, separately, from the disk checkpoint of the same step: the two
  continue bit for bit alike (fp32 master, moments, step count, LR, loss scale, skipped steps) for ``MORE`` steps
  and after ``finish()``;
- 4 ranks on 2 nodes (each rank's records copied to a rank of the other node every step) lose the second node:
  the 2 survivors resume from memory, their own records and the copies they hold, as from disk (acco, sync, acco in
  bf16, fp16 and with int8 rounds; the copies sent as each commit's AdamW inputs, stepped by the holder, or as the
  state; and with a holder whose step of the inputs is planted one bit off: the pair switches to the state);
- 3 ranks on 3 nodes lose nodes 1 and 2, so rank 1's records and their copy are both gone: no resume from memory
  (the error names rank 1), the disk checkpoint is loaded instead;
- every one of those runs with memory_state on keeps ACCO's rounds per step (2 for acco, 1 for dpu and sync);
- 2 ranks on 2 nodes, rank 1 SIGKILLed 1 or GAS - 1 micro-batches into the step after ``SAVE`` (copies and commits
  in flight) and its node's memory removed: rank 0 alone resumes at ``SAVE`` or ``SAVE - 1``, bit for bit in the
  state the uninterrupted run had at that step.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.ranks import launch

pytestmark = pytest.mark.launcher

SAVE, MORE, GAS = 4, 3, 4
CASES = [
    {"name": "sync", "mode": "sync", "dtype": "fp32"},
    {"name": "dpu", "mode": "dpu", "dtype": "fp32"},
    {"name": "acco", "mode": "acco", "dtype": "fp32"},
    {"name": "acco_bf16", "mode": "acco", "dtype": "bf16"},
    {"name": "acco_fp16", "mode": "acco", "dtype": "fp16"},
    {"name": "acco_int8", "mode": "acco", "dtype": "fp32", "compression": True},
    # the paths only a GPU rank takes (the CUDA executor on emulated streams, host summaries read one job late)
    {"name": "acco_fp16_cuda", "mode": "acco", "dtype": "fp16", "cuda_paths": True},
    {"name": "dpu_fp16_cuda", "mode": "dpu", "dtype": "fp16", "cuda_paths": True},
]
SAME_WORLD = ["acco", "acco_fp16", "sync"]
KEYS = ("master", "exp_avg", "exp_avg_sq")
SCALARS = ("step", "lr", "scale", "skipped", "global_steps")
WORKER = launch.REPO / "tests" / "ranks" / "memory_state_worker.py"


# 4 ranks on 2 nodes, the second lost; 2 ranks resume. {variant: (case, extra job keys)}: the copies in the inputs
# form (the default) in every dtype, with a loss scale that moves (skipped commits), on the paths only a GPU rank
# takes (the inputs' captures landing only at the job's host read, as non-blocking copies do) and with int8 rounds;
# in the state form, with a planted mismatch (the pair switches to the state), and with the optimizer state offloaded
NODE_LOST = {
    "acco": ("acco", {}),
    "sync": ("sync", {}),
    "acco_bf16": ("acco_bf16", {}),
    "acco_fp16": ("acco_fp16", {}),
    "acco_fp16_cuda": ("acco_fp16_cuda", {}),
    "acco_int8": ("acco_int8", {}),
    "acco_state": ("acco", {"peer_copy_form": "state"}),
    "acco_mismatch": ("acco", {"plant_mismatch": True}),
    "acco_offload": ("acco", {"offload": True}),
    "sync_offload": ("sync", {"offload": True}),
}
BOTH_LOST = "acco"  # 3 ranks on 3 nodes, nodes 1 and 2 lost: rank 1's records and its copy are gone


def _jobs(tmp) -> list:
    jobs = []
    for c in CASES:
        base = {
            **c,
            "gas": GAS,
            "save_step": SAVE,
            "more": MORE,
            "dir": str(tmp / "shm"),
            "run_id": c["name"],
        }
        base["ckpt"] = str(tmp / "ckpt" / c["name"])
        jobs.append({**base, "kind": "train", "launch": 0})
        if c["name"] in SAME_WORLD:
            jobs.append({**base, "name": f"{c['name']}@2", "kind": "resume", "source": "memory", "launch": 2})
        for source in ("memory", "disk"):
            jobs.append(
                {**base, "name": f"{c['name']}@3/{source}", "kind": "resume", "source": source, "launch": 3}
            )
        for variant, (case, extra) in NODE_LOST.items():
            if case != c["name"]:
                continue
            node = {**base, **extra, "name": f"{variant}/nodes", "run_id": f"{variant}-nodes", "node_size": 2}
            node["ckpt"] = str(tmp / "ckpt" / f"{variant}-nodes")
            jobs.append({**node, "kind": "train", "launch": 1})
            for source in ("memory", "disk"):
                jobs.append(
                    {
                        **node,
                        "name": f"{node['name']}@2/{source}",
                        "kind": "resume",
                        "source": source,
                        "launch": 2,
                    }
                )
        if c["name"] == BOTH_LOST:
            both = {**base, "name": f"{c['name']}/both", "run_id": f"{c['name']}-both", "node_size": 1}
            both["ckpt"] = str(tmp / "ckpt" / f"{c['name']}-both")
            jobs.append({**both, "kind": "train", "launch": 3})
            jobs.append(
                {
                    **both,
                    "name": f"{both['name']}@1",
                    "kind": "resume",
                    "source": "memory",
                    "expect_lost": [1],
                    "launch": 4,
                }
            )
    return jobs


KILLS = [
    1,
    GAS - 1,
]  # acco, 2 ranks on 2 nodes: rank 1 killed this many micro-batches into the step after SAVE


def _kill_jobs(tmp) -> list:
    jobs = []
    for n, kill_micro in enumerate(KILLS):
        name = f"kill{kill_micro}"
        base = {"name": name, "mode": "acco", "dtype": "fp32", "gas": GAS, "save_step": SAVE, "more": MORE,
                "dir": str(tmp / "shm"), "run_id": name, "ckpt": str(tmp / "ckpt" / name), "node_size": 1,
                "killer": 1, "kill_micro": kill_micro}  # fmt: skip
        jobs.append({**base, "kind": "kill", "launch": 10 + 2 * n})
        jobs.append({**base, "name": f"{name}@1", "kind": "resume", "source": "memory", "launch": 11 + 2 * n})
    return jobs


def lose_nodes(folder, ranks) -> None:
    """What losing the nodes of ``ranks`` takes from node memory: their own records and the copies they held."""
    for r in ranks:
        for path in folder.glob(f"rank{r}.g*.*"):
            path.unlink()
        shutil.rmtree(folder / f"held_by_rank{r}", ignore_errors=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory_state")
    jobs = _jobs(tmp) + _kill_jobs(tmp)
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps(jobs))
    out = {}
    for index, world in ((0, 2), (1, 4), (2, 2), (3, 3), (4, 1)):
        if index == 2:
            for name in NODE_LOST:
                lose_nodes(tmp / "shm" / f"{name}-nodes", [2, 3])
        if index == 4:
            lose_nodes(tmp / "shm" / f"{BOTH_LOST}-both", [1, 2])
        args = ["--jobs", spec, "--out", tmp, "--launch_index", str(index)]
        launch.run_local(WORKER, world, args, env=launch.rank_env())
        out.update(torch.load(tmp / f"launch{index}.pt", weights_only=False)[0])
    for n, kill_micro in enumerate(KILLS):  # the launch of the kill ends with the ranks' failures
        args = ["--jobs", spec, "--out", tmp, "--launch_index", str(10 + 2 * n)]
        done = launch.run_local(WORKER, 2, args, env=launch.rank_env(), check=False)
        ref = tmp / f"kill{kill_micro}.ref.pt"
        assert ref.exists(), f"the reference run of kill{kill_micro} did not finish:\n{done.stdout[-6000:]}"
        out[f"kill{kill_micro}/ref"] = torch.load(ref, weights_only=False)
        lose_nodes(tmp / "shm" / f"kill{kill_micro}", [1])
        args = ["--jobs", spec, "--out", tmp, "--launch_index", str(11 + 2 * n)]
        launch.run_local(WORKER, 1, args, env=launch.rank_env())
        out.update(torch.load(tmp / f"launch{11 + 2 * n}.pt", weights_only=False)[0])
    return out


def assert_same_run(name: str, mem: dict, disk: dict) -> None:
    """The two resumed runs continue bit for bit alike (see the module docstring)."""
    assert mem["client_step"] == disk["client_step"] == SAVE
    pairs = [("reload", mem["reload"], disk["reload"])]
    pairs += [(f"step {SAVE + k + 1}", a, b) for k, (a, b) in enumerate(zip(mem["traj"], disk["traj"]))]
    pairs.append(("after finish()", mem["final"], disk["final"]))
    assert len(mem["traj"]) == len(disk["traj"]) == MORE
    for where, a, b in pairs:
        for key in KEYS:
            diff = (a[key] - b[key]).abs().max().item()
            assert torch.equal(a[key], b[key]), f"{name}, {where}: {key} differs (max |diff| {diff:.3e})"
        for key in SCALARS:
            assert a[key] == b[key], f"{name}, {where}: {key} {a[key]} from memory, {b[key]} from disk"


@pytest.mark.parametrize("name", SAME_WORLD)
def test_a_restarted_process_resumes_the_saved_state(runs, name):
    saved, got = runs[name]["at_save"], runs[f"{name}@2"]
    assert got["client_step"] == SAVE
    for key in KEYS:
        assert torch.equal(got["reload"][key], saved[key]), f"{name}: {key} after the resume from memory"
    assert got["reload"]["step"] == saved["step"]
    assert got["reload"]["scale"] == saved["scale"]
    assert got["reload"]["global_steps"] == saved["global_steps"]
    assert all(torch.isfinite(s["master"]).all() for s in got["traj"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_memory_resume_equals_the_disk_resume(runs, case):
    name = case["name"]
    mem, disk = runs[f"{name}@3/memory"], runs[f"{name}@3/disk"]
    assert_same_run(name, mem, disk)
    if case["dtype"] == "fp16":
        scales = {s["scale"] for s in [mem["reload"], *mem["traj"]]}
        assert len(scales) > 1 or mem["final"]["skipped"] > 0, "the loss scaler never moved: no fp16 check"


@pytest.mark.parametrize("name", list(NODE_LOST))
def test_a_lost_node_is_resumed_from_the_copies(runs, name):
    """4 ranks on 2 nodes copy their records to the other node each step; the second node is lost (its memory with
    it) and its 2 ranks' state comes from the copies the first node holds: the same run as from disk."""
    trained = runs[f"{name}/nodes"]
    assert trained["copies"]["peer_copy_steps"] == SAVE
    assert trained["copies"]["peer_copy_bytes_sent"] > 0 and trained["copies"]["peer_copy_bytes_received"] > 0
    assert trained["copies_group_released"] is True  # closing the pipeline released the copies' gloo group
    assert_same_run(f"{name}/nodes", runs[f"{name}/nodes@2/memory"], runs[f"{name}/nodes@2/disk"])


@pytest.mark.parametrize("name", list(NODE_LOST))
def test_the_copies_are_sent_in_the_form_each_commit_allows(runs, name):
    """Rank 0's copies (it sends its own to rank 2 and steps rank 2's): the first commit as the state (the holder has
    nothing to step), every later one as its inputs (with int8 rounds too: at 4 ranks the commit stores the sum and
    steps it with the plain AdamW, and with the captures landing late: none is read before its job's host read),
    except in the state form, with offload (the step runs in host memory on the staged inputs) and after the planted
    mismatch (one commit stepped wrongly, abandoned, then the state)."""
    c = runs[f"{name}/nodes"]["copies"]
    state, inputs, mismatches = (
        c["peer_copy_commits_as_state"], c["peer_copy_commits_as_inputs"], c["peer_copy_mismatches"]
    )  # fmt: skip
    commits = state + inputs
    assert commits >= SAVE - 1, c
    if name in ("acco_state", "acco_offload", "sync_offload"):
        assert (state, inputs, mismatches) == (commits, 0, 0), c
    elif name == "acco_mismatch":
        assert (state, inputs, mismatches) == (commits - 1, 1, 1), c
    else:
        assert (state, inputs, mismatches) == (1, commits - 1, 0), c
    # the CPU test mode of the non-blocking captures ran where the CUDA executor is emulated, and only there
    landed = c["peer_copy_inputs_landed_late"]
    assert (landed > 0) == (name == "acco_fp16_cuda"), c


def test_inputs_copies_send_a_third_of_the_bytes_of_state_copies(runs):
    """fp32, the toy's one group: a commit's state is 12 bytes per shard element; its inputs 4 bytes per element
    plus 40 bytes of step scalars, and an 8-byte verdict back; every step adds its fixed meta message."""
    from acco_ds.core.peer_copies import META_BYTES

    a, b = runs["acco/nodes"]["copies"], runs["acco_state/nodes"]["copies"]
    assert a["peer_copy_steps"] == b["peer_copy_steps"] == SAVE
    commits = b["peer_copy_commits_as_state"]
    state_bytes = (b["peer_copy_bytes_sent"] - SAVE * META_BYTES) // commits
    assert state_bytes % 12 == 0 and state_bytes > 0
    want = SAVE * META_BYTES + state_bytes + (commits - 1) * (state_bytes // 3 + 40 + 8)
    assert a["peer_copy_bytes_sent"] == want, (a, b)


TRAINED = [c["name"] for c in CASES] + [f"{n}/nodes" for n in NODE_LOST] + [f"{BOTH_LOST}/both"]
MODE_OF = {f"{v}/nodes": case for v, (case, _) in NODE_LOST.items()}


CUDA_PATHS = {c["name"] for c in CASES if c.get("cuda_paths")}


@pytest.mark.parametrize("name", TRAINED)
def test_the_rounds_per_step_are_those_of_a_run_without_memory_state(runs, name):
    """With the records written after every commit (and copied to another node in the /nodes and /both runs), the
    schedule is the mode's own: acco runs 2 rounds per step of GAS micro-batches (its peek after GAS/2, then the
    commit), dpu and sync 1. The rounds counted when the worker sees commit k: sync commits inside its step (k);
    dpu and acco commit step k while the first round of step k + 1 is out (one more); on the CUDA paths acco's
    commit k is read with step k + 1's peek, one job late, at that step's boundary (two more)."""
    case = MODE_OF.get(name, name).split("/")[0]
    on_cuda_paths = case in CUDA_PATHS
    cuda = ("StreamExecutor", True) if on_cuda_paths else ("ThreadExecutor", False)
    assert runs[name]["executor"] == cuda, f"{name}: (executor, defer_host_reads) {runs[name]['executor']}"
    mode = case.split("_")[0]
    per_step = 2 if mode == "acco" else 1
    out = 0 if mode == "sync" else (2 if mode == "acco" and on_cuda_paths else 1)
    want = [per_step * k + out for k in range(1, SAVE + 1)]
    assert runs[name]["rounds"] == want, f"{name}: rounds counted when each commit was seen"


def test_a_node_lost_with_its_copys_holder_falls_back_to_disk(runs):
    got, saved = runs[f"{BOTH_LOST}/both@1"], runs[f"{BOTH_LOST}/both"]["at_save"]
    assert got["fell_back"] and got["client_step"] == SAVE
    for key in KEYS:
        assert torch.equal(got["reload"][key], saved[key]), key


@pytest.mark.parametrize("kill_micro", KILLS)
def test_a_node_killed_mid_step_costs_at_most_one_step(runs, kill_micro):
    """Rank 1 (on its own node, the holder of rank 0's copy) is SIGKILLed inside the step after SAVE, its node's
    memory removed: rank 0 resumes alone at SAVE or SAVE - 1, in the state the uninterrupted run had there."""
    got, ref = runs[f"kill{kill_micro}@1"], runs[f"kill{kill_micro}/ref"]
    step = got["client_step"]
    assert SAVE - 1 <= step <= SAVE, f"resumed at step {step}, the last completed was {SAVE}"
    for key in KEYS:
        assert torch.equal(got["reload"][key], ref[step][key]), f"{key} at step {step}"
    assert got["reload"]["step"] == ref[step]["step"]
