"""Tools for operators of a job, run from any machine: what ``elastix status`` (a job's
state), ``elastix dump`` (its workers' stacks) and ``elastix timeline`` (a run's event logs as
one page) read and show; the command line (``elastix.cli``) only parses flags and prints."""
