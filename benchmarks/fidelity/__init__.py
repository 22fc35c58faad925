"""Training fidelity of acco_ds's modes against DeepSpeed ZeRO-1 through ``acco-train``, over paired seeds."""
