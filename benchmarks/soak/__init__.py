"""The soak run: ACCO in adaptive accumulation for thousands of steps while the ranks' speeds keep
changing; checks the micro-batch accounting, flat memory, threads and files, and the loss
(``python -m benchmarks.soak``; ``cli`` drives and checks, ``options`` are shared with the ranks,
each rank runs ``benchmarks.ranks.soak``)."""
