"""The kernel microbenchmarks: ACCO's fused AdamW commit / peek and gradient accumulation against
torch and DeepSpeed anchors, its CPU int8 quantize kernels against their torch reference, and the streaming
bandwidth measured in the same run
(``python -m benchmarks.kernels``; ``cli`` measures, ``table`` renders the raw JSON)."""
