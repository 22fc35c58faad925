"""The main job (``acco-train``) in small single-purpose modules: args, dsconfig, launch, worker
(+ loop, steplog, slowdown, progress), metrics and plots."""
