"""One rank of the check that the engine's all-gather and reduce-scatter work under both names torch has had
for them (lightning_mics/comm/collectives.py): ``all_gather_single`` / ``reduce_scatter_single`` (torch 2.13) and
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before. ``--old-names`` removes the new names from
``torch.distributed`` before the package is imported, as an older torch has them; every call goes through a
recorder, and the results and the names called go to result<rank>.json."""

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

NAMES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--old-names", action="store_true")
    args = ap.parse_args()
    if args.old_names:
        for name in NAMES[:2]:
            if hasattr(dist, name):
                delattr(dist, name)
    has_new_names = hasattr(dist, "all_gather_single")
    called = []
    for name in NAMES:
        fn = getattr(dist, name, None)
        if fn is not None:
            def record(*a, _fn=fn, _name=name, **k):
                called.append(_name)
                return _fn(*a, **k)
            setattr(dist, name, record)

    from lightning_mics.comm import collectives

    own = not dist.is_initialized()  # after other scripts in one launch (tests/helpers/chain.py): theirs
    if own:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(6, dtype=torch.float32) + 10 * rank
    gathered = torch.empty(world * 6)
    full = torch.arange(world * 4, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        collectives.all_gather_single(gathered, mine)
        collectives.reduce_scatter_single(shard, full)
        work = collectives.all_gather_single(gathered, mine, async_op=True)
        work.wait()
    expect_gather = torch.cat([torch.arange(6, dtype=torch.float32) + 10 * r for r in range(world)])
    expect_shard = torch.arange(world * 4, dtype=torch.float32)[rank * 4:(rank + 1) * 4] * sum(range(1, world + 1))
    Path(args.out, f"result{rank}.json").write_text(json.dumps({
        "called": called,
        "has_new_names": has_new_names,
        "gather_ok": torch.equal(gathered, expect_gather),
        "scatter_ok": torch.equal(shard, expect_shard),
        "future_warnings": [str(w.message) for w in seen if issubclass(w.category, FutureWarning)],
    }))
    if own:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
