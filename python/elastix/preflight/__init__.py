"""The pre-flight check (``elastix run --preflight``): before the job's first round trains,
one process per node measures the node's compute (a fixed matrix product) and its links to
other nodes (latency and bandwidth through elastix's collectives, in pairs), and the round's
first member judges them: slow and dead nodes, slow links. The agent that started the check
(rust/core/src/agent/preflight) leaves named nodes out of the round where ``--nnodes`` allows.

* :mod:`.pairs`: which nodes test their link together (two rounds: neighbours, then the
  slowest with the fastest, so that a slow link's two ends are told apart).
* :mod:`.measure`: the measurements.
* :mod:`.verdict`: the judgment and the table (pure).
* :mod:`.check`: one node's part, run by ``python -m elastix.preflight``.
"""
