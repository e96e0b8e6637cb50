"""``python -m elastix.preflight``: one node's part of the pre-flight check (see .check)."""

import os
import sys

# one BLAS thread before NumPy loads: nodes are compared core for core
for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[name] = "1"

from .check import main  # noqa: E402

sys.exit(main())
