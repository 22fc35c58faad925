"""The documented "installs without the compiled kernels" path (setup.py) and the CUDA driver check at load.

A module that is not built (no compiler, no nvcc, ``ACCO_DS_BUILD_CUDA=0``, a failed build in auto mode) must
not make ``setup.py build_ext --inplace`` or ``pip install -e .`` fail: setuptools copies every extension that
is not marked optional and stops with "can't copy ... doesn't exist". The builds here fail at once (the
compilers are ``/bin/false`` and a missing path), so no compilation runs; the copy of the tree holds a CUDA
module from an "earlier build" in the source tree and in the build folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest

from acco_ds.ops import _build

ROOT = Path(__file__).resolve().parents[2]
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def _tree(tmp: Path) -> Path:
    """A copy of what the build reads (no compiled modules, no build folder)."""
    dst = tmp / "tree"
    dst.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    shutil.copytree(ROOT / "csrc", dst / "csrc")
    shutil.copytree(ROOT / "acco_ds", dst / "acco_ds", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return dst


def _env(**extra) -> dict:
    env = dict(os.environ, CXX="/bin/false", NVCC="/nonexistent/nvcc", ACCO_DS_BUILD_EXT="auto")
    env.pop("ACCO_DS_BUILD_CUDA", None)
    env.update(extra)
    return env


def _run(cmd, cwd, env):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return r, r.stdout + r.stderr


@pytest.mark.parametrize("cuda", ["auto", "0"])
def test_build_ext_inplace_without_the_modules(tmp_path, cuda):
    tree = _tree(tmp_path)
    stale_name = f"_adamw_cuda{EXT_SUFFIX}"
    (tree / "acco_ds" / stale_name).write_bytes(b"an earlier in-place build")
    build_lib = tree / "build" / "lib_stale"
    (build_lib / "acco_ds").mkdir(parents=True)
    (build_lib / "acco_ds" / stale_name).write_bytes(b"an earlier build in the build folder")
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace", "--build-lib", str(build_lib)]
    r, out = _run(cmd, tree, _env(ACCO_DS_BUILD_CUDA=cuda))
    assert r.returncode == 0, out[-4000:]
    assert "can't copy" not in out
    assert "installing without it" in out  # the CPU module's build failed (CXX=/bin/false) and was skipped
    assert not (build_lib / "acco_ds" / stale_name).exists(), "a stale build output would be installed"
    assert (tree / "acco_ds" / stale_name).read_bytes() == b"an earlier in-place build"
    for cpu_module in ("_adamw_cpu", "_accumulate_cpu", "_quantize_cpu"):
        assert not list((tree / "acco_ds").glob(f"{cpu_module}*{EXT_SUFFIX}"))


def test_forced_build_still_fails_loudly(tmp_path):
    tree = _tree(tmp_path)
    r, out = _run([sys.executable, "setup.py", "build_ext", "--inplace"], tree, _env(ACCO_DS_BUILD_CUDA="1"))
    assert r.returncode != 0 and "nonexistent" in out, out[-3000:]


def test_pip_install_editable_without_the_modules(tmp_path):
    """``pip install -e .`` (no build isolation: no index needed) into a throw-away environment."""
    tree = _tree(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)  # fmt: skip
    py = venv / "bin" / "python"
    # --system-site-packages shows the BASE interpreter's packages; when the tests run inside a virtual
    # environment, pip, setuptools, wheel and pybind11 are in that environment instead: make it visible too.
    inner = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(inner, "_acco_ds_test_parent_env.pth").write_text("\n".join(sorted(ours)) + "\n")
    cmd = [str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."]
    r, out = _run(cmd, tree, _env())
    assert r.returncode == 0, out[-4000:]
    assert "can't copy" not in out


def _load_setup_module():
    """setup.py as a module (its setup() call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("acco_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_nvcc_vs_torch_cuda_major_warning():
    setup = _load_setup_module()
    assert setup.cuda_major_mismatch("13.0", None) == ""  # CPU torch: nothing to compare
    assert setup.cuda_major_mismatch("13.0", "13.0") == ""
    assert setup.cuda_major_mismatch("12.4", "12.8") == ""
    assert setup.cuda_major_mismatch(None, "12.8") == ""
    msg = setup.cuda_major_mismatch("13.0", "12.8")
    assert "CUDA 13.0" in msg and "12.8" in msg and "580" in msg


def _fake_cuda_module(driver: int, runtime: int, err: int = 0, text: str = ""):
    return types.SimpleNamespace(
        __file__="/x/_adamw_cuda.so", cuda_versions=lambda: (driver, runtime, err, text)
    )


def test_driver_older_than_static_runtime_is_missing():
    assert _build.driver_mismatch(_fake_cuda_module(13000, 13000)) == ""
    assert _build.driver_mismatch(_fake_cuda_module(13020, 13000)) == ""
    assert _build.driver_mismatch(_fake_cuda_module(13000, 13010)) == ""  # minor version compatibility
    why = _build.driver_mismatch(_fake_cuda_module(12080, 13000))
    assert "CUDA 13.0 runtime" in why and "CUDA 12.8 only" in why and "580" in why
    assert "no CUDA driver" in _build.driver_mismatch(_fake_cuda_module(0, 13000))
    assert "cudaErrorUnknown" in _build.driver_mismatch(_fake_cuda_module(0, 0, 999, "cudaErrorUnknown: x"))
    assert "predates" in _build.driver_mismatch(types.SimpleNamespace(__file__="/x/old.so"))


def test_load_treats_a_driver_mismatch_as_missing(monkeypatch):
    fake = _fake_cuda_module(12080, 13000)
    fake.ABI_VERSION = _build.ABI_VERSION
    monkeypatch.setitem(sys.modules, "acco_ds._adamw_cuda", fake)
    monkeypatch.delenv(_build.DISABLE_ENV, raising=False)
    _build.reset_cache()
    try:
        assert _build.load("cuda") is None
        assert "CUDA 12.8 only" in _build.why_missing("cuda")
    finally:
        _build.reset_cache()
