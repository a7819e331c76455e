"""What ``max_live_parameters`` counts ([Note: live cap] in lightning_mics/engine/schedule.py): a gather in flight its
buffers (the padded (s, S) output), a gathered unit its full storage (with its room for staging), the running
unit both during its copy-out. Measured from storages at every dispatched op (tests/helpers/live.py) on a 4-block
GPT whose vocabulary (61 rows) pads the root's shards: the engine's count is never below what is alive, so the cap
bounds what is alive, not only the parameters' full sizes."""

import json

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed

CAP = 20_000
VARIANTS = [{"prefetch": 2, "max_live_parameters": CAP},
            {"reshard_after_forward": False, "max_live_parameters": CAP},  # as test_layouts' KEEP_CAPPED
            {"prefetch": 2}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(REPO / "tests" / "engine" / "live_cap.py", 2, ["--variants", json.dumps(VARIANTS)],
                     tmp_path_factory.mktemp("live_cap"))


def test_the_count_covers_the_gather_buffers(runs):
    for r in runs:
        for v in r["variants"]:
            # every all-gather output is a unit's counted gather buffer, and the padding makes one larger than
            # its unit's full size: counting full sizes fell short of what was alive
            assert set(v["gather_numels"]) <= set(v["gather"]), v
            assert any(g > f for g, f in zip(v["gather"], v["full"])), v
            assert v["over"] == 0, v  # at no op more alive (bytes) than the engine counted
            assert v["stats_peak"] * 4 <= v["counted_peak"]  # the logged peak is the count's


def test_the_cap_holds_what_is_alive(runs):
    for r in runs:
        capped, keep, free = r["variants"]
        running = max(g + s for g, s in zip(capped["gather"], capped["stored"]))
        for v in (capped, keep):
            assert v["counted_peak"] / 4 <= CAP + running, (v["counted_peak"] / 4, CAP, running)
            assert v["measured_peak"] / 4 <= CAP + running, (v["measured_peak"] / 4, CAP, running)
        assert free["counted_peak"] / 4 > CAP + running  # without the cap more is alive: the cap held it
