"""A torch worker: init_process_group("gloo") from the environment elastix run gives it, an
all-reduce of rank + 1, and the sum written to $OUT_DIR/sum_<rank>."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(os.environ["OUT_DIR"], f"sum_{dist.get_rank()}"), "w") as f:
    f.write(str(t.item()))
dist.destroy_process_group()
