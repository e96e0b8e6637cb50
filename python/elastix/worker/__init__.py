"""What runs inside a worker: heartbeats and progress windows, ``timer.expires``, ``@record``
(torch's error file), the function-entrypoint runner and the standby interpreter's start-up."""
