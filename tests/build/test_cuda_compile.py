"""Compile-only checks of the CUDA source with nvcc (no GPU needed); skipped where nvcc is absent.

- csrc/adamw/adamw_cuda.cu compiles to a cubin for sm_80 and for sm_90 with every nvcc warning an error;
- the cubin has vectorised global loads/stores (the kernel's vector path survived compilation);
- the module object links with cudart statically, as setup.py builds it, and exports the launcher.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"  # the include root, as in setup.py
CU = CSRC / "adamw" / "adamw_cuda.cu"


def _nvcc():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


NVCC = _nvcc()
FLAGS = ["-O3", "-std=c++17", "--fmad=false"]  # as setup.py's NVCC_FLAGS
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (compile-only CUDA checks need it)")


def run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_source_compiles(arch, tmp_path):
    cubin = tmp_path / f"adamw_sm{arch}.cubin"
    run([NVCC, *FLAGS, f"-arch=sm_{arch}", "-cubin", "--Werror", "all-warnings", f"-I{CSRC}",
         str(CU), "-o", str(cubin)], tmp_path)  # fmt: skip
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF" and len(data) > 1000
    ptx = tmp_path / f"adamw_sm{arch}.ptx"
    run([NVCC, *FLAGS, f"-arch=sm_{arch}", "-ptx", f"-I{CSRC}", str(CU),
         "-o", str(ptx)], tmp_path)  # fmt: skip
    text = ptx.read_text()
    for instr in ("ld.global.v4.f32", "st.global.v4.f32", "ld.global.v4.u16", "st.global.v4.u16"):
        assert instr in text, f"{instr} missing from the sm_{arch} PTX: the vector path was not compiled"


def test_module_object_links_with_static_cudart(tmp_path):
    obj = tmp_path / "adamw_cuda.o"
    run([NVCC, *FLAGS, "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
         "-Xcompiler", "-fPIC", f"-I{CSRC}", "-c", str(CU), "-o", str(obj)], tmp_path)  # fmt: skip
    so = tmp_path / "libadamw_cuda_test.so"
    run([NVCC, "-shared", "--cudart=static", str(obj), "-o", str(so)], tmp_path)
    nm = shutil.which("nm")
    if nm:
        syms = run([nm, "-D", "-C", "--defined-only", str(so)], tmp_path).stdout
        assert "acco::adamw_cuda(" in syms, "the launcher is not exported"
        assert "cudaLaunchKernel" not in run([nm, "-D", "-C", "--undefined-only", str(so)], tmp_path).stdout


@pytest.mark.parametrize("arch", [80, 90])
def test_triton_accumulate_compiles_for_gpu(arch):
    """Ahead-of-time compile of the Triton accumulate kernel for a GPU target (no GPU needed): the unmasked
    full-chunk path is vectorised (16-byte accesses) when the pointers are aligned, and there is no FMA."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from acco_ds.ops import accumulate
    from acco_ds.ops.triton_kernels.accumulate import accumulate_chunks as kernel

    sig = {"meta_ptr": "*i64", "buf_ptr": "*fp32", "scale": "fp32"}
    sig.update({k: "constexpr" for k in ("CHUNK", "BLOCK", "G_BF16", "B_BF16", "ACC", "ALIGNED")})
    consts = dict(
        CHUNK=accumulate._CHUNK, BLOCK=accumulate._BLOCK, G_BF16=True, B_BF16=False, ACC=True, ALIGNED=True
    )
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs={(0,): [["tt.divisibility", 16]],
                                                                          (1,): [["tt.divisibility", 16]]})  # fmt: skip
    try:
        compiled = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False}
        )
    except RuntimeError as e:  # e.g. a triton wheel without the bundled ptxas
        if "ptxas" in str(e).lower():
            pytest.skip(f"triton cannot assemble for sm_{arch} here: {e}")
        raise
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, "the full-chunk path is not vectorised"
    assert "fma.rn.f32" not in ptx, (
        "x + g*scale was fused into an FMA (results would differ from the reference)"
    )
