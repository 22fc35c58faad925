"""acco_ds.cli.launch: the per-node launcher command acco-train starts is the one DeepSpeed's runner would start for
the same one-node job (the same ``--world_info`` bytes, addresses, target and arguments); the ``deepspeed`` command
users type is kept for the tests of that path; world size and port are read back from either form."""

from __future__ import annotations

import sys

from deepspeed.launcher.runner import encode_world_info

from acco_ds.cli import launch


def test_world_info_is_what_the_runner_encodes():
    for world in (1, 2, 3, 8):
        assert launch.world_info(world) == encode_world_info({"localhost": list(range(world))})


def test_launch_command_is_the_runners_per_node_command():
    cmd = launch.launch_command("/tmp/spec.json", 3, 29500)
    assert cmd == [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={encode_world_info({'localhost': [0, 1, 2]})}",
        "--master_addr=127.0.0.1",
        "--master_port=29500",
        "--log_level=warning",
        "--module",
        "acco_ds.cli.worker",
        "--spec",
        "/tmp/spec.json",
    ]
    script = launch.launch_command(None, 2, 1234, target="/x/rank.py", extra=["--out", "o"])
    assert script[-3:] == ["/x/rank.py", "--out", "o"] and "--module" not in script


def test_runner_command_is_the_deepspeed_command():
    cmd = launch.runner_command(2, 29501, "acco_ds.run", ["train.py", "--deepspeed", "c.json"])
    assert cmd[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    assert cmd[4:] == ["--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", "29501",
                       "--log_level", "warning", "--module", "acco_ds.run", "train.py", "--deepspeed", "c.json"]  # fmt: skip


def test_world_and_port_are_read_back_from_either_form():
    assert launch.launched_world_and_port(launch.launch_command(None, 3, 4242)) == (3, 4242)
    assert launch.launched_world_and_port(launch.runner_command(2, 4343, "m")) == (2, 4343)
    assert launch.launched_world_and_port(["python", "x.py"]) == (None, None)
