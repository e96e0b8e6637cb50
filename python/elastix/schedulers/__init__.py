"""What schedulers tell the processes they start: Slurm's job, step and node list
(:mod:`.slurm`, :mod:`.hostlist`) and a Kubernetes Indexed Job's completion index
(:mod:`.kubernetes`). Pure functions of the environment; ``elastix run`` turns them into
flags (:mod:`elastix.cli.scheduler_flags`)."""
