"""The Triton kernels of acco_ds. Importing any module of this package imports triton.

Nothing imports this package at ``import acco_ds`` or ``import acco_ds.ops.*`` time: the Python fronts
(``acco_ds.ops.accumulate``, ``acco_ds.ops.quantize``, ``acco_ds.ops.norm``, ``acco_ds.ops.adamw_difference``,
``acco_ds.ops.quantized_sum_step``, ``acco_ds.ops.fold_quantize``) import it on their first Triton launch, so acco_ds
runs where triton is absent.

- :mod:`.bf16`: the bf16 <-> fp32 conversions every Triton kernel uses (csrc/common/bf16.h's rule).
- :mod:`.accumulate`: ``accumulate_chunks``, the accumulate / cast-copy kernel over a chunk table.
- :mod:`.quantize`: ``quantize_rows`` / ``quantize_blocks`` (blockwise int8/int4, with the error-feedback
  residual) and ``dequantize_rows`` / ``dequantize_blocks`` (write or add into fp32): several blocks per program
  (blocks of up to 1024 elements), or one block per program.
- :mod:`.norm`: ``sum_of_squares_partials``, the gradient norm's fp64 partial sums (``acco_ds.ops.norm``).
- :mod:`.adamw_difference`: ``adamw_difference_rows``, the AdamW step fused with the quantized parameter
  difference and its application (``acco_ds.ops.adamw_difference``).
- :mod:`.quantized_sum_step`: ``quantized_sum_squares_rows`` and ``adamw_quantized_sum_rows``, the norm's fp64
  partials and the AdamW step (with or without the parameter difference) read straight from the W ranks'
  quantized chunks of a shard (``acco_ds.ops.quantized_sum_step``).
- :mod:`.fold_quantize`: ``fold_quantize_rows`` / ``fold_quantize_blocks``, the fused round end's pass: a
  parameter's last gradient folded into the round's buffer, the blocks it covers whole quantized from buffer +
  gradient (+ the residual) without writing the buffer, the others accumulated; and the leftover blocks quantized
  from the list of their indices (``acco_ds.ops.fold_quantize``).

On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (set before triton is first imported): the tests
check them there bit for bit against the ``*_ref`` functions.
"""
