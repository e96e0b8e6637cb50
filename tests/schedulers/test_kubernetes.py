from __future__ import annotations

import pytest

from elastix.schedulers.kubernetes import completion_index


def test_an_indexed_jobs_pod_has_its_index():
    assert completion_index({"JOB_COMPLETION_INDEX": "3"}) == 3
    assert completion_index({}) is None
    with pytest.raises(ValueError, match="not a completion index"):
        completion_index({"JOB_COMPLETION_INDEX": "-1"})
