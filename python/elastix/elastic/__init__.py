"""Training that survives a re-form in process: when a node is lost or joins, or another
worker fails, the workers that run :func:`run` are not restarted. Their agent tells them at
once that the job re-forms; elastix aborts their collectives (the calls waiting for a lost peer
raise), :func:`run` waits for the worker's place in the new round, joins the new process group
(new ranks, new world size, the same Python objects), opens the checkpoint the survivors agree
on (from the agent's memory, or a peer's) and calls the training function again::

    model = build_model()              # built once: a re-form keeps it

    def train(ckpt: elastix.checkpoint.Checkpoint) -> None:
        state = ckpt.load()            # the step every rank agrees on, or None on a first start
        if state is not None:
            model.load(state)
        start = 0 if ckpt.step is None else ckpt.step + 1
        for step in range(start, steps):
            ...                        # elastix.collectives calls, as usual
            ckpt.save(step, model.state())

    elastix.elastic.run(train)

A re-form for a lost member or a failed worker interrupts the training function where it is
(:class:`Reforming` is raised in it, as a signal's ``KeyboardInterrupt`` would be): a step that
computes is not finished first, since the re-form restores a saved step anyway.
``run(train, interrupt=False)`` lets it run on to its next collective instead. A re-form for a
node that joins loses nothing: every worker finishes the step it computes and stops in its
``ckpt.save`` of the step the agents agreed on (the next one to be saved), and the job goes on
from there.

A worker that dies, or raises anything but a collective's failure, is restarted as before (its
state may be half updated); its peers re-form in process. Plain scripts are unchanged.
"""

from __future__ import annotations

from .interrupt import Reforming
from .loop import run

__all__ = ["Reforming", "run"]
