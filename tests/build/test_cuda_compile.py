"""Compile-only checks of the CUDA source with nvcc and of the Triton kernel (no GPU needed); skipped where nvcc
(or triton's GPU compiler) is absent.

- csrc/adamw/adamw_cuda.cu compiles to a cubin for sm_80 and for sm_90 with every nvcc warning an error, with
  setup.py's NVCC_FLAGS (read from setup.py, so the checks follow the build);
- ptxas reports no register spill (0 bytes spill stores and loads) for any kernel;
- the PTX has vectorised global loads/stores (the kernel's vector path survived compilation) and no ``fma``
  instruction (bit-identity with the CPU harness rests on ``--fmad=false``);
- the module object links with cudart statically, as setup.py builds it, and exports the launcher;
- every variant of the Triton accumulate kernel (gradient dtype x buffer dtype x accumulate/copy x aligned/not:
  16) compiles for sm_90 without FMA; the aligned ones make every access of the full-chunk path 16 bytes wide,
  the others none;
- the quantize row kernels (quantize_rows with fp32/bf16 x and no, fp32 or bf16 residual; dequantize_rows writing
  or adding) compile for sm_90 without FMA, every access of the data 16 bytes wide at the default block size.

Each target is compiled once per session (module-scoped fixtures): about 2 s per nvcc arch and 1 s per Triton
variant on one core.
"""

from __future__ import annotations

import ast
import itertools
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


@pytest.fixture(scope="module", params=["80", "90"])
def nvcc_build(request, tmp_path_factory):
    """adamw_cuda.cu for sm_<arch>, compiled once per session: (arch, cubin bytes, PTX text, ptxas -v output)."""
    if NVCC is None:
        pytest.skip("nvcc not found (compile-only CUDA checks need it)")
    arch = request.param
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


TRITON_VARIANTS = list(itertools.product((False, True), repeat=4))  # G_BF16, B_BF16, ACC, ALIGNED
THREADS = 4 * 32  # Triton's default num_warps (the launch sets none) x 32


def triton_compile(arch: int, g_bf16: bool, b_bf16: bool, acc: bool, aligned: bool) -> str:
    """The PTX of one variant of the accumulate kernel for sm_<arch>, as the launch compiles it: no FP fusion,
    16-byte divisible pointers (torch's allocations; the unaligned launch gets no such hint for the gradients)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from acco_ds.ops import accumulate
    from acco_ds.ops.triton_kernels.accumulate import accumulate_chunks as kernel

    sig = {
        "meta_ptr": "*i64",
        "grad_ptr": "*bf16" if g_bf16 else "*fp32",
        "buf_ptr": "*bf16" if b_bf16 else "*fp32",
    }
    sig["scale"] = "fp32"
    sig.update({k: "constexpr" for k in ("CHUNK", "BLOCK", "G_BF16", "B_BF16", "ACC", "ALIGNED")})
    consts = dict(CHUNK=accumulate._CHUNK, BLOCK=accumulate._BLOCK, G_BF16=g_bf16, B_BF16=b_bf16, ACC=acc,
                  ALIGNED=aligned)  # fmt: skip
    attrs = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    if aligned:
        attrs[(1,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    try:
        compiled = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False}
        )
    except RuntimeError as e:  # e.g. a triton wheel without the bundled ptxas
        if "ptxas" in str(e).lower():
            pytest.skip(f"triton cannot assemble for sm_{arch} here: {e}")
        raise
    return compiled.asm["ptx"]


@pytest.fixture(scope="module")
def triton_ptx():
    """Every variant for sm_90, compiled once per session: {(G_BF16, B_BF16, ACC, ALIGNED): PTX}."""
    pytest.importorskip("triton")
    return {v: triton_compile(90, *v) for v in TRITON_VARIANTS}


def expected_vector_accesses(g_bf16: bool, b_bf16: bool, acc: bool) -> tuple:
    """16-byte (v4.b32) global loads and stores of one full chunk per thread: the gradient's bytes (+ the buffer's
    when accumulating) read, the buffer's written, 16 bytes per access."""
    from acco_ds.ops import accumulate

    per_thread = accumulate._CHUNK // THREADS
    g, b = (2 if g_bf16 else 4), (2 if b_bf16 else 4)
    return per_thread * (g + (b if acc else 0)) // 16, per_thread * b // 16


@pytest.mark.parametrize("variant", TRITON_VARIANTS, ids=lambda v: "g{}_b{}_{}_{}".format(
    "bf16" if v[0] else "f32", "bf16" if v[1] else "f32", "acc" if v[2] else "copy", "al" if v[3] else "un"))  # fmt: skip
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
    ptx = triton_compile(80, True, False, True, True)
    assert (ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32")) == expected_vector_accesses(
        True, False, True
    )
    assert not FMA.search(ptx)


# The quantize row kernels (acco_ds/ops/triton_kernels/quantize.py) at the default block size: (X_BF16, residual
# dtype or None) for quantize_rows, ADD for dequantize_rows.
QUANTIZE_VARIANTS = [(xb, rd) for xb in (False, True) for rd in (None, "fp32", "bf16")]


def quantize_compile(kernel_name: str, sig: dict, consts: dict, divisible: tuple) -> str:
    """The PTX of a quantize kernel for sm_90 as a launch on a shard compiles it: no FP fusion, 16-byte divisible
    pointers, and the integer arguments divisible by 16 (shards are multiples of 16 elements,
    acco_ds.core.buffers.ALIGN, and Triton specializes such arguments)."""
    from acco_ds.ops.triton_kernels import quantize as kernels

    return sm90_ptx(getattr(kernels, kernel_name), sig, consts, divisible)


def sm90_ptx(fn, sig: dict, consts: dict, divisible: tuple = ()) -> str:
    """The PTX of the Triton kernel ``fn`` for sm_90 without FP fusion (the arguments named in ``divisible``
    marked 16-divisible); skips where this triton cannot assemble for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    except RuntimeError as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"triton cannot assemble for sm_90 here: {e}")
        raise
    return compiled.asm["ptx"]


@pytest.mark.parametrize(
    "variant", QUANTIZE_VARIANTS, ids=lambda v: f"x{'bf16' if v[0] else 'f32'}_res{v[1]}"
)
def test_triton_quantize_rows_compile_vectorised(variant):
    """quantize_rows at block size 256 (8 rows of 256 a program): no FMA (the residual's v - q * scale rounds
    twice, as the reference), and every access of x, the residual and q 16 bytes wide: per thread 16 elements,
    so 16 * bytes / 16 v4 loads of x (and of the residual) and stores of the residual and of q; the one scalar
    store is the row's scale."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q

    x_bf16, res = variant
    rows, tile = q._rows(256), q._tile(256)
    sig = {
        "x_ptr": "*bf16" if x_bf16 else "*fp32",
        "res_ptr": ("*bf16" if res == "bf16" else "*fp32") if res else ("*bf16" if x_bf16 else "*fp32"),
        "q_ptr": "*i8",
        "scale_ptr": "*fp32",
        "n": "i64",
        "nb": "i64",
        "block_size": "i32",
    }
    sig.update({k: "constexpr" for k in ("QMAX", "TILE", "ROWS", "X_BF16", "HAS_RES", "RES_BF16", "SUB")})
    consts = dict(
        QMAX=127,
        TILE=tile,
        ROWS=rows,
        X_BF16=x_bf16,
        HAS_RES=res is not None,
        RES_BF16=res == "bf16",
        SUB=False,
    )
    ptx = quantize_compile(
        "quantize_rows", sig, consts, ("x_ptr", "res_ptr", "q_ptr", "scale_ptr", "n", "block_size")
    )
    assert not FMA.search(ptx), f"{variant}: v - q * scale was fused into an FMA"
    per_thread = rows * tile // THREADS
    xb, rb = (2 if x_bf16 else 4), {None: 0, "fp32": 4, "bf16": 2}[res]
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
    sig.update({k: "constexpr" for k in ("TILE", "ROWS", "ADD", "BF16")})
    ptx = quantize_compile("dequantize_rows", sig, dict(TILE=tile, ROWS=rows, ADD=add, BF16=False),
                           ("q_ptr", "scale_ptr", "base_ptr", "out_ptr", "n", "block_size"))  # fmt: skip
    assert not FMA.search(ptx), "the sum out + q * scale was fused into an FMA"
    per_thread = rows * tile // THREADS
    want = (per_thread * (1 + (4 if add else 0)) // 16, per_thread * 4 // 16)
    got = (ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32"))
    assert got == want, f"add={add}: (v4 loads, v4 stores) {got}, expected {want}"


@pytest.mark.parametrize("p_bf16", [True, False], ids=["p_bf16", "p_fp32"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "peek"])
def test_triton_adamw_difference_compiles_for_sm90(commit, p_bf16):
    """The fused AdamW + parameter difference kernel (acco_ds/ops/triton_kernels/adamw_difference.py) compiles for
    sm_90 at block size 256 as the round job launches it (bf16 gradients, the device's scale and noop flag), with no
    FMA (the AdamW update and the dequantized sum round each operation, as the CUDA and CPU kernels do) and the
    IEEE division and square root (div.rn / sqrt.rn, not the approximate ones)."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q
    from acco_ds.ops.triton_kernels.adamw_difference import adamw_difference_rows

    pdt = "*bf16" if p_bf16 else "*fp32"
    sig = {
        "p_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "g_ptr": "*bf16", "base_ptr": pdt, "out_ptr": pdt,
        "q_ptr": "*i8", "qscale_ptr": "*fp32", "hyper_ptr": "*fp32", "gscale_ptr": "*fp32", "noop_ptr": "*i32",
        "grad_scale": "fp32", "n": "i64", "nb": "i64", "block_size": "i32",
    }  # fmt: skip
    consts = dict(QMAX=127, TILE=q._tile(256), ROWS=q._rows(256), G_BF16=True, P_BF16=p_bf16, COMMIT=commit,
                  HAS_GSCALE=True, HAS_NOOP=True)  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    ptx = sm90_ptx(adamw_difference_rows, sig, consts)
    assert not FMA.search(ptx), "an FMA: the AdamW update or the dequantized sum was contracted"
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, "the IEEE division / square root were not used"
    assert "div.full.f32" not in ptx and "sqrt.approx.f32" not in ptx


@pytest.mark.parametrize("diff", [True, False], ids=["difference", "plain"])
@pytest.mark.parametrize("commit", [True, False], ids=["commit", "peek"])
def test_triton_quantized_sum_step_compiles_for_sm90(commit, diff):
    """The AdamW step read from the quantized chunks (acco_ds/ops/triton_kernels/quantized_sum_step.py) compiles for
    sm_90 at block size 256 as the round job launches it (a bf16 sum with the kept g~, bf16 parameters, the device's
    scale and noop flag), with no FMA and the IEEE division and square root; so does its norm's kernel."""
    pytest.importorskip("triton")
    from acco_ds.ops import quantize as q
    from acco_ds.ops.triton_kernels.quantized_sum_step import (
        adamw_quantized_sum_rows,
        quantized_sum_squares_rows,
    )

    sig = {
        "p_ptr": "*fp32", "m_ptr": "*fp32", "v_ptr": "*fp32", "q_ptr": "*i8", "qscale_ptr": "*fp32",
        "order_ptr": "*i64", "tilde_ptr": "*bf16", "base_ptr": "*bf16", "out_ptr": "*bf16", "dq_ptr": "*i8",
        "dscale_ptr": "*fp32", "hyper_ptr": "*fp32", "gscale_ptr": "*fp32", "noop_ptr": "*i32", "grad_scale": "fp32",
        "n": "i64", "nb": "i64", "block_size": "i32", "nrows": "i32",
    }  # fmt: skip
    consts = dict(QMAX=127, TILE=q._tile(256), ROWS=q._rows(256), S_BF16=True, P_BF16=True, COMMIT=commit,
                  HAS_GSCALE=True, HAS_NOOP=True, HAS_TILDE=True, DIFF=diff)  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    ptx = sm90_ptx(adamw_quantized_sum_rows, sig, consts)
    assert not FMA.search(ptx), "an FMA: the rows' sum or the AdamW update was contracted"
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, "the IEEE division / square root were not used"
    assert "div.full.f32" not in ptx and "sqrt.approx.f32" not in ptx
    norm_sig = {
        "q_ptr": "*i8", "scales_ptr": "*fp32", "order_ptr": "*i64", "tilde_ptr": "*bf16", "tilde_out_ptr": "*bf16",
        "partials_ptr": "*fp64", "n": "i64", "nb": "i64", "block_size": "i32", "nrows": "i32",
    }  # fmt: skip
    norm_consts = dict(
        TILE=q._tile(256), ROWS=q._rows(256), S_BF16=True, HAS_TILDE=not commit, HAS_TILDE_OUT=commit
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
    consts = dict(QMAX=127, TILE=q._tile(bs), ROWS=q._rows(bs), FOLD=fold, B_BF16=bdt == "bf16",
                  G_BF16=gdt == "bf16", HAS_RES=rdt is not None, RES_BF16=rdt == "bf16")  # fmt: skip
    if not rows:
        del consts["ROWS"]
    sig.update({k: "constexpr" for k in consts})
    # the pointers, offset, chunk, block size; the range's end and its first / last blocks are never specialized
    divisible = (*(name for name in sig if name.endswith("_ptr")), "offset", "chunk", "block_size")
    ptx = sm90_ptx(fold_quantize_rows if rows else fold_quantize_blocks, sig, consts, divisible)
    assert not FMA.search(ptx), f"{variant}: v - q * scale was fused into an FMA"
    assert "div.rn.f32" in ptx and "div.full.f32" not in ptx, f"{variant}: not the IEEE division"
    if rows:  # the whole blocks' path: 16 elements a thread, every access 16 bytes wide
        size = {"fp32": 4, "bf16": 2, None: 0}
        per_thread = consts["ROWS"] * consts["TILE"] // THREADS
        want = (per_thread * (size[bdt] + size[gdt] + size[rdt]) // 16, per_thread * (size[rdt] + 1) // 16)
        got = (ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32"))
        assert got == want, f"{variant}: (v4 loads, v4 stores) {got}, expected {want}"
