"""Writes this worker's environment contract to $OUT_DIR/<round>_<rank>.json."""

import json
import os

KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "ELASTIX_RANK",
    "ELASTIX_ROUND",
]
env = {key: os.environ.get(key) for key in KEYS}
env["pid"] = os.getpid()
out = os.environ["OUT_DIR"]
with open(os.path.join(out, f"{env['ELASTIX_ROUND']}_{env['RANK']}.json"), "w") as f:
    json.dump(env, f)
