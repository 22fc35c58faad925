"""The GPU overlap benchmark: does ACCO's side stream overlap the compute on one GPU, with a
calibrated device sleep standing in for the communication (``python -m benchmarks.gpu_overlap``;
``cli`` measures and renders). Importing it touches neither torch nor transformers."""
