"""A job whose own code fails to import (its dataset, optimizer, loss or schedule) exits 2 with
one line naming the field, found while Ray starts."""

import pytest

from tests.helpers.bad_jobs import DEEP_BAD_JOBS, assert_refused


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("mapping, expected", DEEP_BAD_JOBS, ids=[e for _, e in DEEP_BAD_JOBS])
def test_job_that_fails_on_import_exits_2(tmp_path, capsys, mapping, expected):
    assert_refused(tmp_path, capsys, mapping, expected)
