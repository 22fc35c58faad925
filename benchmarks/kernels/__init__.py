"""The kernel microbenchmarks: ACCO's fused AdamW commit / peek and gradient accumulation against
torch and DeepSpeed anchors, its int8 quantize kernels (C++ on the CPU, Triton on a GPU) against their torch reference, and the streaming
bandwidth measured in the same run
(``python -m benchmarks.kernels``; ``cli`` measures, ``table`` renders the raw JSON)."""
