"""tests/ranks/cpuinfo_cache.py: DeepSpeed's CPU probe is made once per machine and answered from its file after,
in the suite's own process and in the processes it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.ranks import cpuinfo_cache

cpuinfo = pytest.importorskip("cpuinfo.cpuinfo")


def test_one_probe_then_the_file(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(
        cpuinfo, "get_cpu_info_json", lambda: calls.append(1) or '{"arch": "X86_64", "count": 2}'
    )
    monkeypatch.setenv(cpuinfo_cache.CACHE_ENV, str(tmp_path / "cpu.json"))
    assert cpuinfo_cache.install()
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and cpuinfo.get_cpu_info()["count"] == 2
    assert len(calls) == 1  # the second answer came from the file
    assert json.loads((tmp_path / "cpu.json").read_text()) == {"arch": "X86_64", "count": 2}


def test_a_failed_probe_is_not_kept(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info_json", lambda: calls.append(1) or "{}")
    monkeypatch.setenv(cpuinfo_cache.CACHE_ENV, str(tmp_path / "cpu.json"))
    assert cpuinfo_cache.install()
    assert cpuinfo.get_cpu_info() == {} and cpuinfo.get_cpu_info() == {}
    assert len(calls) == 2 and not (tmp_path / "cpu.json").exists()


def test_unset_changes_nothing(monkeypatch):
    monkeypatch.delenv(cpuinfo_cache.CACHE_ENV, raising=False)
    before = cpuinfo.get_cpu_info_json
    assert not cpuinfo_cache.install() and cpuinfo.get_cpu_info_json is before


def test_a_process_the_suite_starts_reads_the_file(tmp_path):
    """The session's PYTHONPATH (tests/conftest.py) runs the ranks' start-up hook in any child Python: it answers
    from the session's file without probing (a planted answer proves which)."""
    path = tmp_path / "planted.json"
    path.write_text('{"arch": "PLANTED", "count": 7}')
    env = dict(os.environ, **{cpuinfo_cache.CACHE_ENV: str(path)})
    code = "import cpuinfo; print(cpuinfo.get_cpu_info()['arch'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "PLANTED"
