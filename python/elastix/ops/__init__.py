"""Tools for operators of a job, run from any machine: ``elastix timeline`` (a run's event logs as one page)."""
