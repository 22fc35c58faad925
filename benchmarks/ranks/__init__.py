"""Per-rank scripts: what the DeepSpeed launcher starts once per rank for a benchmark, run as
modules (``--module benchmarks.ranks.<name>``; the launcher's ``rank_env`` puts the repository
root on ``PYTHONPATH``). Each parses ``--local_rank`` (set by the launcher) and writes its figures
to a file named by its options; none is meant to be run by hand."""
