"""Works for $FINISH_AFTER_<group rank> seconds (default 0), then exits 0: nodes that finish at
different times, for tests of the exit barrier."""

import os
import time

group_rank = os.environ["GROUP_RANK"]
print(f"worker of group rank {group_rank} working", flush=True)
time.sleep(float(os.environ.get(f"FINISH_AFTER_{group_rank}", "0")))
