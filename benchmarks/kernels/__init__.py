"""The kernel microbenchmarks: ACCO's fused AdamW commit / peek and gradient accumulation against
torch and DeepSpeed anchors and the streaming bandwidth measured in the same run
(``python -m benchmarks.kernels``; ``cli`` measures, ``table`` renders the raw JSON)."""
