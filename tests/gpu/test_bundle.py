"""The offline wheel bundle for the lent GPU machine (scripts/gpu/bundle.sh -> .gpu_bundle/), when it exists.

- every wheel installs on CPython 3.12 x86-64 Linux (tags cp312 / abi3 / py3, manylinux x86_64 or any), one
  version per project, the checksums match, and requirements.txt names wheels that are there;
- where a Python 3.12 interpreter is found: the wheels install offline (``--no-index``) into a fresh virtual
  environment, and the requirements resolve offline with the bundle alone next to stand-ins for what the GPU
  image brings (torch 2.11.0 and numpy 2.5.2 as metadata-only wheels: no GPU stack here).

Skipped without the bundle (a fresh clone has none: it is ignored by git).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".gpu_bundle"


def _python312():
    """A working CPython 3.12 interpreter (a pyenv shim may exist and fail), or None."""
    for exe in (shutil.which("python3.12"), "/root/.pyenv/versions/3.12.1/bin/python"):
        if not exe or not Path(exe).exists():
            continue
        code = "import sys; print(sys.version_info[:2] == (3, 12))"
        r = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip() == "True":
            return exe
    return None


PY312 = _python312() if BUNDLE.is_dir() else None
pytestmark = pytest.mark.skipif(not BUNDLE.is_dir(), reason="no .gpu_bundle (run scripts/gpu/bundle.sh)")


def wheels():
    return sorted(BUNDLE.glob("*.whl"))


def _tag_ok(tag) -> bool:
    stable_abi = tag.abi == "abi3" and tag.interpreter.startswith("cp") and int(tag.interpreter[2:]) <= 312
    interp_ok = tag.interpreter in ("cp312", "py3", "py312") or stable_abi
    abi_ok = tag.abi in ("cp312", "abi3", "none")
    plat_ok = tag.platform == "any" or (
        tag.platform.startswith("manylinux") and tag.platform.endswith("x86_64")
    )
    return interp_ok and abi_ok and plat_ok


def test_every_wheel_fits_cpython312_x86_64():
    found = wheels()
    assert found, "the bundle holds no wheel"
    names = {}
    for whl in found:
        name, version, _, tags = parse_wheel_filename(whl.name)
        assert any(_tag_ok(t) for t in tags), f"{whl.name}: no tag for CPython 3.12 x86-64 Linux"
        assert name not in names, f"two versions of {name}: {names[name]} and {version}"
        names[name] = version
    assert str(names["deepspeed"]) == "0.19.8"
    size = sum(w.stat().st_size for w in found)
    assert size < 32 * 2**20, f"{size / 2**20:.1f} MiB: the tree and the bundle travel in 64 MiB together"
    for required in ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection"):
        assert required in names, f"{required} is missing from the bundle"


def test_checksums_and_requirements_match_the_wheels():
    sums = dict(reversed(line.split(maxsplit=1)) for line in (BUNDLE / "SHA256SUMS").read_text().splitlines())
    for whl in wheels():
        assert sums[f"./{whl.name}"] == hashlib.sha256(whl.read_bytes()).hexdigest(), whl.name
    have = {parse_wheel_filename(w.name)[0]: str(parse_wheel_filename(w.name)[1]) for w in wheels()}
    for line in (BUNDLE / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            assert have.get(canonicalize_name(name)) == version, line


def _stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A metadata-only wheel standing for a package of the GPU image."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    whl = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return whl


@pytest.mark.skipif(PY312 is None, reason="no Python 3.12 interpreter here")
def test_bundle_installs_offline_into_a_fresh_python312(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([PY312, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index, no find-links, no constraints from this machine's config
    pip = [py, "-m", "pip", "install", "--quiet", "--no-index", "--disable-pip-version-check"]

    def run(args):
        r = subprocess.run(pip + args, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    run(["--no-deps", *map(str, wheels())])  # every wheel installs on 3.12 as it is
    code = "import hjson, pydantic, pydantic_core, cpuinfo, msgpack; print(pydantic.VERSION)"
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "2.13.4", r.stderr[-2000:]

    fresh = tmp_path / "fresh"
    subprocess.run([PY312, "-m", "venv", str(fresh)], check=True, timeout=300)
    pip[0] = str(fresh / "bin" / "python")
    stubs = tmp_path / "image"
    stubs.mkdir()
    run([str(_stub_wheel(stubs, "torch", "2.11.0")), str(_stub_wheel(stubs, "numpy", "2.5.2"))])
    run(["--find-links", str(BUNDLE), "-r", str(BUNDLE / "requirements.txt")])
    check = subprocess.run(
        [pip[0], "-m", "pip", "check"], env=env, capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr
