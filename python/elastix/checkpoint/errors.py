"""The error of a checkpoint that cannot be saved or restored."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or restored: the message says what and why."""
