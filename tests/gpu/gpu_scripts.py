"""The GPU tooling of scripts/gpu/ as modules for the tests that read it on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GPU_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "gpu"


def load(stem: str):
    """scripts/gpu/STEM.py as the module ``gpu_STEM`` (no package: the GPU machine runs ``python
    scripts/gpu/STEM.py``), the name its siblings load it under; the first module of that name stays the one
    registered in ``sys.modules``, and is the one returned."""
    name = f"gpu_{stem}"
    spec = importlib.util.spec_from_file_location(name, GPU_SCRIPTS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return sys.modules[name]
