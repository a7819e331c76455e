"""What the strategy leaves behind: fits with different layouts in one process do not pile up
process groups, and a layout used again after its groups were released trains exactly as the first time.
The exit itself is covered by every multi-process test (each rank must exit 0) and, 50 runs at a time, by
tests/stress (LIGHTNING_MICS_STRESS=1)."""

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed


def test_fits_with_other_layouts_do_not_grow_the_live_groups(tmp_path):
    res = run_ranks(REPO / "tests" / "layout" / "layouts.py", 4, [], tmp_path)
    for r in res:
        after_s2, after_s4, after_s2_again = r["groups"]
        assert after_s4 <= after_s2 and after_s2_again <= after_s2, r["groups"]
        assert r["first_equals_third"], "the same layout after a release trained differently"
        assert r["s2_vs_s4_max_abs"] < 1e-5, r  # another layout, the same training up to summation order
