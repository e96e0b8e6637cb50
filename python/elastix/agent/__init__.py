"""What runs in the agent's process: the launch API (``LaunchConfig``, ``launch``), the agent's
configuration and data model, the rendezvous handler API, worker output specs and the
standby interpreters. The agent itself is Rust (``elastix._core``); this wing prepares its
input and reads its output.

(The wing is ``agent``, not ``launch``: ``elastix.launch`` is torch's launch function.)"""
