"""Compile-only checks of the CUDA source with nvcc and of the Triton kernel (no GPU needed); skipped where nvcc
(or triton's GPU compiler) is absent.

- csrc/adamw/adamw_cuda.cu compiles to a cubin for sm_75 (T4), sm_80 and sm_90 with every nvcc warning an error,
  with setup.py's NVCC_FLAGS (read from setup.py, so the checks follow the build), and for sm_70 (V100) where the
  nvcc can target it (CUDA 13 dropped Volta: skipped there, saying so);
- ptxas reports no register spill (0 bytes spill stores and loads) for any kernel;
- the PTX has vectorised global loads/stores (the kernel's vector path survived compilation) and no ``fma``
  instruction (bit-identity with the CPU harness rests on ``--fmad=false``);
- the module object links with cudart statically, as setup.py builds it, and exports the launcher;
- every variant of the Triton accumulate kernel (gradient dtype x buffer dtype x accumulate/copy x aligned/not:
  the 16 of fp32 and bf16, and the 12 with fp16 beside itself or fp32) compiles for sm_90 without FMA; the aligned
  ones make every access of the full-chunk path 16 bytes wide, the others none;
- the quantize row kernels (quantize_rows with fp32/bf16/fp16 x and no, fp32, bf16 or fp16 residual;
  dequantize_rows writing or adding) compile for sm_90 without FMA, every access of the data 16 bytes wide at the
  default block size;
- every Triton kernel, with fp16 data, compiles for sm_70 (V100: ``acco_ds.ops._build.TRITON_MIN_CAPABILITY``, the
  lowest the ops send to Triton) and sm_75 (T4) without FMA and with the IEEE division and square root.

Each target is compiled once per session (module-scoped fixtures): about 2 s per nvcc arch and 1 s per Triton
variant on one core.
"""

from __future__ import annotations

import ast
import os
import re
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


def setup_nvcc_flags() -> list:
    """setup.py's ``NVCC_FLAGS`` (a literal list), without the host compiler's ``-Xcompiler`` options."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NVCC_FLAGS" for t in node.targets):
            flags = ast.literal_eval(node.value)
            break
    else:
        raise AssertionError("setup.py has no literal NVCC_FLAGS list")
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == "-Xcompiler":
            skip = True
        else:
            out.append(f)
    return out


NVCC = _nvcc()
FLAGS = setup_nvcc_flags()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (compile-only CUDA checks need it)")


def run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def nvcc_archs() -> set:
    """The SM versions this nvcc compiles for (``nvcc --list-gpu-arch``: compute_75, compute_80, ...)."""
    r = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True, timeout=60)
    return set(re.findall(r"compute_(\d+)", r.stdout))


@pytest.fixture(scope="module", params=["70", "75", "80", "90"])
def nvcc_build(request, tmp_path_factory):
    """adamw_cuda.cu for sm_<arch>, compiled once per session: (arch, cubin bytes, PTX text, ptxas -v output)."""
    if NVCC is None:
        pytest.skip("nvcc not found (compile-only CUDA checks need it)")
    arch = request.param
    if arch not in nvcc_archs():
        version = run([NVCC, "--version"], ROOT).stdout.strip().splitlines()[-1]
        pytest.skip(f"this nvcc cannot target sm_{arch} ({version}; CUDA 13 dropped sm_70, Volta): build the CUDA "
                    f"module for a V100 with CUDA 12 (ACCO_DS_CUDA_ARCHS=70)")  # fmt: skip
    tmp = tmp_path_factory.mktemp(f"nvcc_sm{arch}")
    cubin, ptx = tmp / "adamw.cubin", tmp / "adamw.ptx"
    r = run([NVCC, *FLAGS, f"-arch=sm_{arch}", "-cubin", "--Werror", "all-warnings", "-Xptxas", "-v",
             f"-I{CSRC}", str(CU), "-o", str(cubin)], tmp)  # fmt: skip
    run([NVCC, *FLAGS, f"-arch=sm_{arch}", "-ptx", f"-I{CSRC}", str(CU), "-o", str(ptx)], tmp)
    return arch, cubin.read_bytes(), ptx.read_text(), r.stdout + r.stderr


def test_cuda_source_compiles(nvcc_build):
    arch, cubin, ptx, _ = nvcc_build
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
    for instr in ("ld.global.v4.f32", "st.global.v4.f32", "ld.global.v4.u16", "st.global.v4.u16"):
        assert instr in ptx, f"{instr} missing from the sm_{arch} PTX: the vector path was not compiled"


def spills(ptxas_log: str) -> list:
    """``[(function, spill store bytes, spill load bytes), ...]`` from ``ptxas -v`` output (one per function)."""
    out, fn = [], None
    for line in ptxas_log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            fn = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out.append((fn, int(m.group(1)), int(m.group(2))))
    return out


def test_no_register_spills(nvcc_build):
    arch, _, _, log = nvcc_build
    entries = len(re.findall(r"Compiling entry function", log))
    found = spills(log)
    assert entries > 0 and len(found) >= entries, f"cannot read ptxas -v output for sm_{arch}:\n{log[-3000:]}"
    spilled = [f for f in found if f[1] or f[2]]
    assert not spilled, f"register spills on sm_{arch} (function, store bytes, load bytes): {spilled}"


def test_spill_parser_reads_ptxas_lines():
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
        "ptxas info    : Function properties for k1\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Function properties for k2\n"
        "    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
    )
    assert spills(log) == [("k1", 0, 0), ("k2", 8, 4)]


FMA = re.compile(r"^\s*(@!?%p\d+\s+)?fma\.", re.M)


def test_no_fma_in_cuda_ptx(nvcc_build):
    """Bit-identity with the CPU harness rests on --fmad=false: not one fused multiply-add in the PTX."""
    arch, _, ptx, _ = nvcc_build
    n = len(FMA.findall(ptx))
    assert n == 0, (
        f"{n} fma instructions in the sm_{arch} PTX (nvcc contracted a*b+c; setup.py flags {FLAGS})"
    )


@needs_nvcc
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


# (G_DT, B_DT, ACC, ALIGNED): dtype codes 0 fp32, 1 bf16, 2 fp16 (acco_ds.ops._dtypes.DTYPE_CODE); every fp32 / bf16
# pair, and fp16 beside itself and fp32
PAIRS = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (2, 0), (0, 2)]
TRITON_VARIANTS = [(g, b, acc, al) for g, b in PAIRS for acc in (False, True) for al in (False, True)]
PTR = {0: "*fp32", 1: "*bf16", 2: "*fp16"}
SIZE = {0: 4, 1: 2, 2: 2}
THREADS = 4 * 32  # Triton's default num_warps (the launch sets none) x 32


def compile_for(arch: int, fn, sig: dict, consts: dict, attrs: dict):
    """``triton.compile`` of the kernel ``fn`` for sm_<arch> as the launches compile it (no FP fusion); skips where
    this triton cannot assemble for that architecture."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False})
    except RuntimeError as e:  # e.g. a triton wheel without the bundled ptxas
        if "ptxas" in str(e).lower():
            pytest.skip(f"triton cannot assemble for sm_{arch} here: {e}")
        raise


def triton_compile(arch: int, g_dt: int, b_dt: int, acc: bool, aligned: bool) -> str:
    """The PTX of one variant of the accumulate kernel for sm_<arch>, as the launch compiles it: no FP fusion,
    16-byte divisible pointers (torch's allocations; the unaligned launch gets no such hint for the gradients)."""
    from acco_ds.ops import accumulate
    from acco_ds.ops.triton_kernels.accumulate import accumulate_chunks as kernel

    sig = {"meta_ptr": "*i64", "grad_ptr": PTR[g_dt], "buf_ptr": PTR[b_dt], "scale": "fp32"}
    sig.update({k: "constexpr" for k in ("CHUNK", "BLOCK", "G_DT", "B_DT", "ACC", "ALIGNED")})
    consts = dict(CHUNK=accumulate._CHUNK, BLOCK=accumulate._BLOCK, G_DT=g_dt, B_DT=b_dt, ACC=acc,
                  ALIGNED=aligned)  # fmt: skip
    attrs = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    if aligned:
        attrs[(1,)] = [["tt.divisibility", 16]]
    return compile_for(arch, kernel, sig, consts, attrs).asm["ptx"]


@pytest.fixture(scope="module")
def triton_ptx():
    """Every variant for sm_90, compiled once per session: {(G_DT, B_DT, ACC, ALIGNED): PTX}."""
    pytest.importorskip("triton")
    return {v: triton_compile(90, *v) for v in TRITON_VARIANTS}


def expected_vector_accesses(g_dt: int, b_dt: int, acc: bool) -> tuple:
    """16-byte (v4.b32) global loads and stores of one full chunk per thread: the gradient's bytes (+ the buffer's
    when accumulating) read, the buffer's written, 16 bytes per access."""
    from acco_ds.ops import accumulate

    per_thread = accumulate._CHUNK // THREADS
    g, b = SIZE[g_dt], SIZE[b_dt]
    return per_thread * (g + (b if acc else 0)) // 16, per_thread * b // 16


@pytest.mark.parametrize("variant", TRITON_VARIANTS, ids=lambda v: "g{}_b{}_{}_{}".format(
    PTR[v[0]][1:], PTR[v[1]][1:], "acc" if v[2] else "copy", "al" if v[3] else "un"))  # fmt: skip
def test_triton_variant_compiles_for_gpu(triton_ptx, variant):
    """No FMA in any variant; the aligned ones: every access of the unmasked full-chunk path 16 bytes wide (as
    many v4.b32 loads/stores as a chunk's bytes per thread / 16); the unaligned ones: no vector access at all
    (a misaligned vector access faults)."""
    ptx = triton_ptx[variant]
    assert not FMA.search(ptx), f"{variant}: x + g*scale was fused into an FMA (the bits would differ)"
    loads, stores = ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32")
    if variant[3]:
        assert (loads, stores) == expected_vector_accesses(*variant[:3]), (variant, loads, stores)
    else:
        assert not re.search(r"(ld|st)\.global\.v\d", ptx), f"{variant}: vector access on the unaligned path"


def test_triton_accumulate_compiles_for_sm80():
    """sm_80 (A100): the aligned bf16-gradient accumulate variant, vectorised and without FMA."""
    pytest.importorskip("triton")
    ptx = triton_compile(80, 1, 0, True, True)
    assert (ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32")) == expected_vector_accesses(
        1, 0, True
    )
    assert not FMA.search(ptx)


# The quantize row kernels (acco_ds/ops/triton_kernels/quantize.py) at the default block size: (x dtype, residual
# dtype or None) for quantize_rows, ADD for dequantize_rows.
QUANTIZE_VARIANTS = [(xd, rd) for xd in ("fp32", "bf16", "fp16") for rd in (None, "fp32", "bf16", "fp16")]
CODE = {"fp32": 0, "bf16": 1, "fp16": 2}
BYTES = {None: 0, "fp32": 4, "bf16": 2, "fp16": 2}


def quantize_compile(kernel_name: str, sig: dict, consts: dict, divisible: tuple) -> str:
    """The PTX of a quantize kernel for sm_90 as a launch on a shard compiles it: no FP fusion, 16-byte divisible
    pointers, and the integer arguments divisible by 16 (shards are multiples of 16 elements,
    acco_ds.core.buffers.ALIGN, and Triton specializes such arguments)."""
    from acco_ds.ops.triton_kernels import quantize as kernels

    return sm90_ptx(getattr(kernels, kernel_name), sig, consts, divisible)


def sm90_ptx(fn, sig: dict, consts: dict, divisible: tuple = (), arch: int = 90) -> str:
    """The PTX of the Triton kernel ``fn`` for sm_<arch> (default 90) without FP fusion (the arguments named in
    ``divisible`` marked 16-divisible); skips where this triton cannot assemble for it."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in divisible}
    compiled = compile_for(arch, fn, sig, consts, attrs)
    assert "cubin" in compiled.asm, f"no cubin for sm_{arch}"
    return compiled.asm["ptx"]


@pytest.mark.parametrize("variant", QUANTIZE_VARIANTS, ids=lambda v: f"x{v[0]}_res{v[1]}")
def test_triton_quantize_rows_compile_vectorised(variant):
    """quantize_rows at block size 256 (8 rows of 256 a program): no FMA (the residual's v - q * scale rounds
    twice, as the reference), and every access of x, the residual and q 16 bytes wide: per thread 16 elements,
    so 16 * bytes / 16 v4 loads of x (and of the residual) and stores of the residual and of q; the one scalar
    store is the row's scale."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q

    xd, res = variant
    rows, tile = q._rows(256), q._tile(256)
    sig = {
        "x_ptr": f"*{xd}",
        "res_ptr": f"*{res or xd}",
        "q_ptr": "*i8",
        "scale_ptr": "*fp32",
        "n": "i64",
        "nb": "i64",
        "block_size": "i32",
    }
    sig.update({k: "constexpr" for k in ("QMAX", "TILE", "ROWS", "X_DT", "HAS_RES", "RES_DT", "SUB")})
    consts = dict(
        QMAX=127,
        TILE=tile,
        ROWS=rows,
        X_DT=CODE[xd],
        HAS_RES=res is not None,
        RES_DT=CODE[res or xd],
        SUB=False,
    )
    ptx = quantize_compile(
        "quantize_rows", sig, consts, ("x_ptr", "res_ptr", "q_ptr", "scale_ptr", "n", "block_size")
    )
    assert not FMA.search(ptx), f"{variant}: v - q * scale was fused into an FMA"
    per_thread = rows * tile // THREADS
    xb, rb = BYTES[xd], BYTES[res]
    want = (per_thread * (xb + rb) // 16, per_thread * (rb + 1) // 16)
    got = (ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32"))
    assert got == want, f"{variant}: (v4 loads, v4 stores) {got}, expected {want}"
    assert not re.search(r"ld\.global\.(b16|b8|v2)", ptx), f"{variant}: narrow loads of the data"


@pytest.mark.parametrize("add", [True, False])
def test_triton_dequantize_rows_compile_vectorised(add):
    """dequantize_rows at block size 256: q read and the fp32 sum read (ADD) and written 16 bytes wide."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q

    rows, tile = q._rows(256), q._tile(256)
    sig = {
        "q_ptr": "*i8",
        "scale_ptr": "*fp32",
        "base_ptr": "*fp32",
        "out_ptr": "*fp32",
        "n": "i64",
        "nb": "i64",
        "block_size": "i32",
    }
    sig.update({k: "constexpr" for k in ("TILE", "ROWS", "ADD", "DT")})
    ptx = quantize_compile("dequantize_rows", sig, dict(TILE=tile, ROWS=rows, ADD=add, DT=0),
                           ("q_ptr", "scale_ptr", "base_ptr", "out_ptr", "n", "block_size"))  # fmt: skip
    assert not FMA.search(ptx), "the sum out + q * scale was fused into an FMA"
    per_thread = rows * tile // THREADS
    want = (per_thread * (1 + (4 if add else 0)) // 16, per_thread * 4 // 16)
    got = (ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32"))
    assert got == want, f"add={add}: (v4 loads, v4 stores) {got}, expected {want}"


@pytest.mark.parametrize("gdt,pdt", [("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp16", "fp32")])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "peek"])
def test_triton_adamw_difference_compiles_for_sm90(commit, gdt, pdt):
    """The fused AdamW + parameter difference kernel (acco_ds/ops/triton_kernels/adamw_difference.py) compiles for
    sm_90 at block size 256 as the round job launches it (bf16 or fp16 gradients, the device's scale and noop flag), with no
    FMA (the AdamW update and the dequantized sum round each operation, as the CUDA and CPU kernels do) and the
    IEEE division and square root (div.rn / sqrt.rn, not the approximate ones)."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q
    from acco_ds.ops.triton_kernels.adamw_difference import adamw_difference_rows

    sig = {
        "p_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "g_ptr": f"*{gdt}", "base_ptr": f"*{pdt}",
        "out_ptr": f"*{pdt}",
        "q_ptr": "*i8", "qscale_ptr": "*fp32", "hyper_ptr": "*fp32", "gscale_ptr": "*fp32", "noop_ptr": "*i32",
        "grad_scale": "fp32", "n": "i64", "nb": "i64", "block_size": "i32",
    }  # fmt: skip
    consts = dict(QMAX=127, TILE=q._tile(256), ROWS=q._rows(256), G_DT=CODE[gdt], P_DT=CODE[pdt], COMMIT=commit,
                  HAS_GSCALE=True, HAS_NOOP=True)  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    ptx = sm90_ptx(adamw_difference_rows, sig, consts)
    assert not FMA.search(ptx), "an FMA: the AdamW update or the dequantized sum was contracted"
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, "the IEEE division / square root were not used"
    assert "div.full.f32" not in ptx and "sqrt.approx.f32" not in ptx


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("diff", [True, False], ids=["difference", "plain"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "peek"])
def test_triton_quantized_sum_step_compiles_for_sm90(commit, diff, half):
    """The AdamW step read from the quantized chunks (acco_ds/ops/triton_kernels/quantized_sum_step.py) compiles for
    sm_90 at block size 256 as the round job launches it (a bf16 or fp16 sum with the kept g~, parameters of that dtype, the device's
    scale and noop flag), with no FMA and the IEEE division and square root; so does its norm's kernel."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q
    from acco_ds.ops.triton_kernels.quantized_sum_step import (
        adamw_quantized_sum_rows,
        quantized_sum_squares_rows,
    )

    sig = {
        "p_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "q_ptr": "*i8", "qscale_ptr": "*fp32",
        "order_ptr": "*i64", "tilde_ptr": f"*{half}", "base_ptr": f"*{half}", "out_ptr": f"*{half}", "dq_ptr": "*i8",
        "dscale_ptr": "*fp32", "hyper_ptr": "*fp32", "gscale_ptr": "*fp32", "noop_ptr": "*i32", "grad_scale": "fp32",
        "n": "i64", "nb": "i64", "block_size": "i32", "nrows": "i32",
    }  # fmt: skip
    consts = dict(QMAX=127, TILE=q._tile(256), ROWS=q._rows(256), S_DT=CODE[half], P_DT=CODE[half], COMMIT=commit,
                  HAS_GSCALE=True, HAS_NOOP=True, HAS_TILDE=True, DIFF=diff)  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    ptx = sm90_ptx(adamw_quantized_sum_rows, sig, consts)
    assert not FMA.search(ptx), "an FMA: the rows' sum or the AdamW update was contracted"
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, "the IEEE division / square root were not used"
    assert "div.full.f32" not in ptx and "sqrt.approx.f32" not in ptx
    norm_sig = {
        "q_ptr": "*i8", "scales_ptr": "*fp32", "order_ptr": "*i64", "tilde_ptr": f"*{half}",
        "tilde_out_ptr": f"*{half}",
        "partials_ptr": "*fp64", "n": "i64", "nb": "i64", "block_size": "i32", "nrows": "i32",
    }  # fmt: skip
    norm_consts = dict(
        TILE=q._tile(256), ROWS=q._rows(256), S_DT=CODE[half], HAS_TILDE=not commit, HAS_TILDE_OUT=commit
    )
    norm_sig.update({k: "constexpr" for k in norm_consts})
    assert not FMA.search(sm90_ptx(quantized_sum_squares_rows, norm_sig, norm_consts)), (
        "an FMA in the rows' sum"
    )


# The fused round end's kernels (acco_ds/ops/triton_kernels/fold_quantize.py): (row kernel, FOLD, buffer, gradient,
# residual dtype or None): the round job's bf16 buffer with an fp32 residual, the mixed dtypes, no residual; the
# one-block kernel (blocks longer than a tile).
FOLD_VARIANTS = [
    (True, True, "bf16", "bf16", "fp32"),
    (True, True, "fp32", "bf16", "bf16"),
    (True, True, "bf16", "fp32", None),
    (True, False, "bf16", None, "fp32"),
    (False, True, "bf16", "bf16", "fp32"),
    (False, False, "fp32", None, None),
    (True, True, "fp16", "fp16", "fp32"),
    (True, True, "fp32", "fp16", "fp16"),
    (True, False, "fp16", None, "fp16"),
    (False, True, "fp16", "fp16", "fp32"),
]


@pytest.mark.parametrize("variant", FOLD_VARIANTS, ids=lambda v: "{}_{}_b{}_g{}_r{}".format(
    "rows" if v[0] else "blocks", "fold" if v[1] else "listed", *v[2:]))  # fmt: skip
def test_triton_fold_quantize_compiles_for_sm90(variant):
    """fold_quantize_rows (block size 256) and fold_quantize_blocks (2048) compile for sm_90 as the fused round end
    launches them (16-byte divisible pointers, chunk, block size and the gradient's offset 16-divisible: a parameter
    of the packed layout), with no FMA (``v - q * scale`` rounds twice, as the reference) and the IEEE
    division (div.rn); the row kernel reads the buffer, the gradient and the residual and writes the residual and q
    16 bytes wide where it quantizes (the partly covered blocks' accumulation, in two programs, need not be)."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q
    from acco_ds.ops.triton_kernels.fold_quantize import fold_quantize_blocks, fold_quantize_rows

    rows, fold, bdt, gdt, rdt = variant
    bs = 256 if rows else 2048
    sig = {
        "buf_ptr": f"*{bdt}", "grad_ptr": f"*{gdt or bdt}", "res_ptr": f"*{rdt or bdt}", "q_ptr": "*i8",
        "scale_ptr": "*fp32", "blocks_ptr": "*i64", "offset": "i64", "end": "i64", "first": "i64",
    }  # fmt: skip
    if rows:
        sig["last"] = "i64"
    sig.update({"chunk": "i64", "nb": "i64", "block_size": "i32"})
    consts = dict(QMAX=127, TILE=q._tile(bs), ROWS=q._rows(bs), FOLD=fold, B_DT=CODE[bdt], G_DT=CODE[gdt or bdt],
                  HAS_RES=rdt is not None, RES_DT=CODE[rdt or bdt])  # fmt: skip
    if not rows:
        del consts["ROWS"]
    sig.update({k: "constexpr" for k in consts})
    # the pointers, offset, chunk, block size; the range's end and its first / last blocks are never specialized
    divisible = (*(name for name in sig if name.endswith("_ptr")), "offset", "chunk", "block_size")
    ptx = sm90_ptx(fold_quantize_rows if rows else fold_quantize_blocks, sig, consts, divisible)
    assert not FMA.search(ptx), f"{variant}: v - q * scale was fused into an FMA"
    assert "div.rn.f32" in ptx and "div.full.f32" not in ptx, f"{variant}: not the IEEE division"
    if rows:  # the whole blocks' path: 16 elements a thread, every access 16 bytes wide
        size = BYTES
        per_thread = consts["ROWS"] * consts["TILE"] // THREADS
        want = (per_thread * (size[bdt] + size[gdt] + size[rdt]) // 16, per_thread * (size[rdt] + 1) // 16)
        got = (ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32"))
        assert got == want, f"{variant}: (v4 loads, v4 stores) {got}, expected {want}"


def lowest_target_kernels() -> dict:
    """Every Triton kernel with fp16 data (and a bf16 one: the accumulate kernel's gradient), as its launch compiles
    it: {name: (kernel, signature, constexprs)}."""
    from acco_ds.ops import accumulate
    from acco_ds.ops import quantize as q
    from acco_ds.ops.triton_kernels import accumulate as acc_kernels
    from acco_ds.ops.triton_kernels import adamw_difference, fold_quantize, norm, quantized_sum_step
    from acco_ds.ops.triton_kernels import quantize as qk

    tile, rows = q._tile(256), q._rows(256)

    def const(**kw):
        return {k: "constexpr" for k in kw}, kw

    adamw = {"p_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32"}
    tail = {"hyper_ptr": "*fp32", "gscale_ptr": "*fp32", "noop_ptr": "*i32", "grad_scale": "fp32"}
    kernels = {
        "accumulate": acc_kernels.accumulate_chunks,
        "quantize_rows": qk.quantize_rows,
        "dequantize_sum_rows": qk.dequantize_sum_rows,
        "norm": norm.sum_of_squares_partials,
        "adamw_difference": adamw_difference.adamw_difference_rows,
        "adamw_quantized_sum": quantized_sum_step.adamw_quantized_sum_rows,
        "fold_quantize_rows": fold_quantize.fold_quantize_rows,
    }
    sigs = {
        "accumulate": ({"meta_ptr": "*i64", "grad_ptr": "*fp16", "buf_ptr": "*bf16", "scale": "fp32"},
                       const(CHUNK=accumulate._CHUNK, BLOCK=accumulate._BLOCK, G_DT=2, B_DT=1, ACC=True,
                             ALIGNED=True)),
        "quantize_rows": ({"x_ptr": "*fp16", "res_ptr": "*fp16", "q_ptr": "*i8", "scale_ptr": "*fp32", "n": "i64",
                           "nb": "i64", "block_size": "i32"},
                          const(QMAX=127, TILE=tile, ROWS=rows, X_DT=2, HAS_RES=True, RES_DT=2, SUB=False)),
        "dequantize_sum_rows": ({"q_ptr": "*i8", "scale_ptr": "*fp32", "order_ptr": "*i64", "out_ptr": "*fp16",
                                 "n": "i64", "nb": "i64", "block_size": "i32", "num_rows": "i32"},
                                const(TILE=tile, ROWS=rows, OUT_DT=2)),
        "norm": ({"x_ptr": "*fp16", "out_ptr": "*fp64", "n": "i64"}, const(PER_PROGRAM=1 << 15, TILE=1024, X_DT=2)),
        "adamw_difference": ({**adamw, "g_ptr": "*fp16", "base_ptr": "*fp16", "out_ptr": "*fp16", "q_ptr": "*i8",
                              "qscale_ptr": "*fp32", **tail, "n": "i64", "nb": "i64", "block_size": "i32"},
                             const(QMAX=127, TILE=tile, ROWS=rows, G_DT=2, P_DT=2, COMMIT=True, HAS_GSCALE=True,
                                   HAS_NOOP=True)),
        "adamw_quantized_sum": ({**adamw, "q_ptr": "*i8", "qscale_ptr": "*fp32", "order_ptr": "*i64",
                                 "tilde_ptr": "*fp16", "base_ptr": "*fp16", "out_ptr": "*fp16", "dq_ptr": "*i8",
                                 "dscale_ptr": "*fp32", **tail, "n": "i64", "nb": "i64", "block_size": "i32",
                                 "nrows": "i32"},
                                const(QMAX=127, TILE=tile, ROWS=rows, S_DT=2, P_DT=2, COMMIT=True, HAS_GSCALE=True,
                                      HAS_NOOP=True, HAS_TILDE=True, DIFF=True)),
        "fold_quantize_rows": ({"buf_ptr": "*fp16", "grad_ptr": "*fp16", "res_ptr": "*fp32", "q_ptr": "*i8",
                                "scale_ptr": "*fp32", "blocks_ptr": "*i64", "offset": "i64", "end": "i64",
                                "first": "i64", "last": "i64", "chunk": "i64", "nb": "i64", "block_size": "i32"},
                               const(QMAX=127, TILE=tile, ROWS=rows, FOLD=True, B_DT=2, G_DT=2, HAS_RES=True,
                                     RES_DT=0)),
    }  # fmt: skip
    out = {}
    for name, fn in kernels.items():
        sig, (csig, consts) = sigs[name]
        out[name] = (fn, {**sig, **csig}, consts)
    return out


@pytest.mark.parametrize("arch", [70, 75], ids=["sm_70", "sm_75"])
def test_triton_kernels_compile_for_v100_and_t4(arch):
    """Every Triton kernel with fp16 data assembles for sm_70 (V100) and sm_75 (T4), the GPUs without bf16 that the
    fp16 mode is for: no FMA, the IEEE division and square root where the kernel divides. sm_70 is
    ``acco_ds.ops._build.TRITON_MIN_CAPABILITY``: below it the ops take their torch forms."""
    pytest.importorskip("triton")
    from acco_ds.ops import _build

    assert _build.TRITON_MIN_CAPABILITY == (7, 0)
    for name, (fn, sig, consts) in lowest_target_kernels().items():
        divisible = tuple(k for k in sig if k.endswith("_ptr")) + ("block_size",)
        ptx = sm90_ptx(fn, sig, consts, divisible, arch=arch)
        assert f".target sm_{arch}" in ptx, (name, arch)
        assert not FMA.search(ptx), f"{name} sm_{arch}: an FMA"
        if "div.rn.f32" in ptx or name in ("quantize_rows", "adamw_difference", "fold_quantize_rows"):
            assert "div.full.f32" not in ptx and "sqrt.approx.f32" not in ptx, (
                f"{name} sm_{arch}: approximate math"
            )
            assert "div.rn.f32" in ptx, f"{name} sm_{arch}: not the IEEE division"
