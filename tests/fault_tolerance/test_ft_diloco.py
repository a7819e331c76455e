"""``MiCSStrategy(replica_sync="diloco", fault_tolerance=True)`` under the Trainer and Fabric, with real processes: a real
torchft lighthouse, each replica group (2 ranks, s = 2 inside) a job of its own whose ranks are forked from the test
launcher's server with torchrun's environment (tests/helpers/ft_groups.py), rank script ft_trainer.py beside this file.

- with no failure, two groups (H = 3, accumulation 2) equal each other and the same 4-rank DiLoCo job without fault
  tolerance (s = 2, r = 2: the job tests/diloco checks against its simulation) bit for bit, with fp32 and with int8
  pseudo-gradients, the latter also under bf16-mixed;
  the groups meet only at sync steps: torchft's Manager (counted on the Manager itself) forms a quorum at the
  start and at the first batch of each later sync step, and averages one flat buffer at the end of each sync step;
- a sync not committed on one group (an error reported to its Manager): its masters go back to the anchors, the
  window is dropped, and at the next sync it takes its peer's state; both end bit-equal;
- streaming fragments (delay 1, mixing 0.5): each group bit-equal to its replica in the 4-rank job (Trainer,
  Fabric); a fragment's sync not committed on one group resets that fragment's masters only, and the group takes
  its peer's state at the next send;
- a group killed mid-window: the survivor goes on stepping and syncing alone (quorum 1), the group started again
  takes a live peer's state at a sync step and both end at the last step with bit-equal parameters; under streaming,
  killed with a fragment in flight, it joins at a send step and the groups' anchors are bit-equal from then on;
- under Fabric, the same two groups equal the 4-rank Fabric job without fault tolerance bit for bit, and a group
  killed mid-window and started again takes the inner step count with the state (its loop resumes at the peer's
  step, a sync step) and ends with its peer.

Bounds such as "within 60 s" are timeouts here, not measured figures.
"""

import pytest
import torch

from tests.helpers.ft_groups import FTJob, records, wait_for
from tests.helpers.launch import REPO, free_port, run_ranks

pytestmark = pytest.mark.distributed
pytest.importorskip("torchft")
SCRIPT = REPO / "tests" / "fault_tolerance" / "ft_trainer.py"


def _load(path):
    return torch.load(path, weights_only=False)


def _differ(a, b, tol=0.0):
    return [k for k in a["params"] if (a["params"][k] - b["params"][k]).abs().max().item() > tol]


def _check(job, codes):
    logs = [job.log(job.current(g))[-4000:] for g in range(2)]
    assert codes == [0, 0], "\n".join(f"--- group {g} (exit {c}) ---\n{t}" for g, (c, t) in enumerate(zip(codes, logs)))
    assert all(f"lightning_mics from {REPO}" in t for t in logs), "the ranks imported another checkout's package"


def _two_groups_and_the_job(tmp_path, mode, reference, args):
    """Two groups of ``mode`` (min_replicas=2: both in every quorum), then the same loop as one 4-rank job without
    fault tolerance (``--mode reference``); the three results, group 0's, group 1's and the job's."""
    ports = [free_port() for _ in range(2)]
    with FTJob(tmp_path, [None, None], ["127.0.0.1"] * 2, ports[0], ports[1]) as job:
        job.lighthouse(min_replicas=2)
        for g in range(2):
            job.start(g, ["--mode", mode, "--out", str(tmp_path), *args], forked=True)
        _check(job, [job.wait(g, timeout=400) for g in range(2)])
    run_ranks(SCRIPT, 4, ["--mode", reference, *args], tmp_path, timeout=300,
              extra_env={"LOCAL_WORLD_SIZE": "4"})
    return [_load(tmp_path / f"{t}.pt") for t in (f"{mode}0", f"{mode}1", reference)]


@pytest.mark.parametrize("int8, precision", [(False, "32-true"), (True, "32-true"), (True, "bf16-mixed")],
                         ids=["fp32", "int8", "int8-bf16-mixed"])
def test_two_groups_equal_the_diloco_job_without_fault_tolerance(tmp_path, int8, precision):
    """2 groups x 2 ranks, H = 3, accumulation 2, 6 steps (two outer syncs) against the 4-rank job; ``int8``: int8
    pseudo-gradients (quantize_gradients=True), over the manager's process group in the same two hops as over the
    4-rank job's replica group; ``bf16-mixed``: the inner steps' compute in bf16, the pseudo-gradients from the fp32
    masters."""
    steps = ["--steps", "6", "--accum", "2", "--opt", "sgd", "--diloco", "3", "--precision", precision,
             *(["--int8"] if int8 else [])]
    ft0, ft1, mics = _two_groups_and_the_job(tmp_path, "ft", "mics", steps)
    assert ft0["global_step"] == ft1["global_step"] == mics["global_step"] == 6
    assert _differ(ft0, ft1) == []
    # bit for bit: the same inner steps in each group, and the mean of two pseudo-gradients is (a + b) / 2 through
    # either the replica group's all-reduce or the manager's
    assert _differ(ft0, mics) == []
    for s in (ft0["summary"], ft1["summary"]):  # two decisions (the outer syncs), both committed with both groups
        assert (s["steps"], s["committed"], s["failed"], s["participants_min"], s["participants_max"]) == \
            (2, 2, 0, 2, 2), s
    # batches 0-11: step k is batches 2k-2, 2k-1; the syncs end steps 3 and 6. Quorums: at on_train_start (batch
    # -1) for the first sync, at step 6's first batch for the second; one flat allreduce at the end of each sync step
    numel = {n for _, op, n in ft0["traffic"] if op == "allreduce"}
    assert [(b, op) for b, op, _ in ft0["traffic"]] == [(-1, "quorum"), (5, "allreduce"), (10, "quorum"),
                                                         (11, "allreduce")], ft0["traffic"]
    assert len(numel) == 1 and numel.pop() > 0


@pytest.mark.parametrize("mode, reference, int8", [("ft", "mics", False), ("fabric", "fabric-mics", False),
                                                   ("ft", "mics", True)], ids=["trainer", "fabric", "trainer-int8"])
def test_streaming_fragments_across_groups_equal_the_job_without_fault_tolerance(tmp_path, mode, reference, int8):
    """Streaming DiLoCo across the groups: H = 4, 2 fragments, each fragment's average in flight over the manager's
    group for 1 inner step (sync_delay; with int8 its first hop) and merged with half the local progress, 6 steps
    (three fragment syncs); each group bit-equal to its replica in the 4-rank job without fault tolerance (Trainer
    and Fabric; with mixing and fragments the replicas never hold one model), one decision per fragment sync."""
    steps = ["--steps", "6", "--accum", "2", "--opt", "sgd", "--diloco", "4", "--fragments", "2", "--delay", "1",
             "--mixing", "0.5", *(["--int8"] if int8 else [])]
    g0, g1, job = _two_groups_and_the_job(tmp_path, mode, reference, steps)
    assert g0["global_step"] == g1["global_step"] == job["global_step"] == 6
    assert _differ(g0, job) == [] and _differ(g1, _load(tmp_path / f"{reference}_replica1.pt")) == []
    assert _differ(g0, g1, tol=1e-3) != []  # the local progress mixing keeps
    for s in (g0["summary"], g1["summary"]):  # the fragment syncs sent after steps 1, 3, 5, applied after 2, 4, 6
        assert (s["steps"], s["committed"], s["failed"], s["participants_min"]) == (3, 3, 0, 2), s
    if mode == "ft":  # step k is batches 2k-2, 2k-1: each send step's quorum at its first batch, its allreduce at its
        # last (in flight over the next step's two batches)
        assert [(b, op) for b, op, _ in g0["traffic"]] == [(-1, "quorum"), (1, "allreduce"), (4, "quorum"),
                                                           (5, "allreduce"), (8, "quorum"), (9, "allreduce")], \
            g0["traffic"]


def test_a_sync_not_committed_drops_the_window_and_heals_at_the_next(tmp_path):
    """Group 0 reports an error to its Manager at its second sync (step 4, H = 2): should_commit is False there, its
    masters equal its anchors after the step (the first sync's model), its peer commits; at step 6's first batch group
    0 is one commit behind and takes group 1's state; both end at step 8 bit-equal."""
    args = ["--mode", "ft", "--out", str(tmp_path), "--steps", "8", "--diloco", "2", "--opt", "sgd", "--record"]
    ports = [free_port() for _ in range(2)]
    with FTJob(tmp_path, [None, None], ["127.0.0.1"] * 2, ports[0], ports[1]) as job:
        job.lighthouse(min_replicas=2)
        job.start(0, [*args, "--error-at", "2"], forked=True)
        job.start(1, args, forked=True)
        _check(job, [job.wait(g, timeout=400) for g in range(2)])
    ra, rb = records(tmp_path / "ft0_steps.jsonl"), records(tmp_path / "ft1_steps.jsonl")
    assert [r["committed"] for r in ra] == [True] * 3 + [False] * 2 + [True] * 3, ra  # the last decision's
    assert all(r["committed"] for r in rb), rb
    assert ra[3]["dropped"] == 1 and ra[3]["masters"] == ra[3]["anchors"] == ra[1]["masters"], ra[:4]
    assert rb[3]["masters"] != ra[3]["masters"]  # group 1 took the outer step
    ft0, ft1 = _load(tmp_path / "ft0.pt"), _load(tmp_path / "ft1.pt")
    assert _differ(ft0, ft1) == []
    s0, s1 = ft0["summary"], ft1["summary"]
    assert (s0["committed"], s0["failed"], s1["committed"], s1["failed"]) == (3, 1, 4, 0), (s0, s1)
    assert s0["committed_steps"] == s1["committed_steps"] == 4  # group 0's count came back with the heal
    assert s0["recoveries"] >= 1 and s1["peers_healed"] >= 1, (s0, s1)


def _lose_group_one(tmp_path, mode, args, hold, held, what):
    """Both groups of ``mode`` under one lighthouse (min_replicas=1), group 1 with ``--hold hold``; group 1 killed once
    one of its records' steps is ``held``, the survivor's first sync alone awaited, group 1 started again and both
    waited for. Returns group 0's and group 1's records, the step group 1 was killed after, the kill's and the
    restart's times."""
    a, b = tmp_path / f"{mode}0_steps.jsonl", tmp_path / f"{mode}1_steps.jsonl"
    ports = [free_port() for _ in range(2)]
    with FTJob(tmp_path, [None, None], ["127.0.0.1"] * 2, ports[0], ports[1]) as job:
        job.lighthouse(min_replicas=1, heartbeat_ms=2000)
        job.start(0, args, forked=True)
        job.start(1, [*args, "--hold", str(hold)], forked=True)
        wait_for(lambda: job.check() and any(held(r["step"]) for r in records(b)), 240, what=what)
        killed = job.kill(1)
        before = records(b)[-1]["step"]
        wait_for(lambda: job.check() and any(r["t"] > killed and r["quorum"] == 1 for r in records(a)), 60,
                 what="a sync of the surviving group alone")
        job.start(1, args, forked=True)
        restarted = job.started_at[1][-1]
        _check(job, [job.wait(g, timeout=400) for g in range(2)])
        job.stop_lighthouse()
    return records(a), records(b), before, killed, restarted


def test_a_fragment_sync_not_committed_drops_that_fragment_and_heals_at_the_next_send(tmp_path):
    """Streaming (H = 4, two fragments, delay 1, mixing 0.5): group 0 reports an error to its Manager at its second
    allreduce (fragment 1's, sent after step 3 and in flight over step 4): at its apply after step 4 should_commit is
    False there, fragment 1's masters go back to its anchors while fragment 0 keeps its own; its peer commits; at step
    5's first batch (fragment 0's send step) group 0 is one commit behind and takes group 1's state; by step 8 both
    committed the same count."""
    args = ["--mode", "ft", "--out", str(tmp_path), "--steps", "8", "--diloco", "4", "--fragments", "2", "--delay",
            "1", "--mixing", "0.5", "--opt", "sgd", "--record"]
    ports = [free_port() for _ in range(2)]
    with FTJob(tmp_path, [None, None], ["127.0.0.1"] * 2, ports[0], ports[1]) as job:
        job.lighthouse(min_replicas=2)
        job.start(0, [*args, "--error-at", "2"], forked=True)
        job.start(1, args, forked=True)
        _check(job, [job.wait(g, timeout=400) for g in range(2)])
    ra, rb = records(tmp_path / "ft0_steps.jsonl"), records(tmp_path / "ft1_steps.jsonl")
    assert [r["committed"] for r in ra] == [True] * 3 + [False] * 2 + [True] * 3, ra  # the last decision's
    assert all(r["committed"] for r in rb), rb
    at4 = ra[3]
    assert at4["dropped"] == 1 and at4["fragment_masters"][1] == at4["fragment_anchors"][1], at4
    assert at4["fragment_masters"][0] != at4["fragment_anchors"][0], at4  # fragment 0 keeps its local progress
    assert rb[3]["fragment_masters"][1] != at4["fragment_masters"][1]  # group 1 took the outer step
    s0, s1 = _load(tmp_path / "ft0.pt")["summary"], _load(tmp_path / "ft1.pt")["summary"]
    assert (s0["committed"], s0["failed"], s1["committed"], s1["failed"]) == (3, 1, 4, 0), (s0, s1)
    assert s0["committed_steps"] == s1["committed_steps"] == 4  # group 0's count came back with the heal
    assert s0["recoveries"] >= 1 and s1["peers_healed"] >= 1, (s0, s1)


def test_a_group_lost_mid_window_rejoins_at_a_sync(tmp_path):
    """Group 1's ranks killed after step 7 (one step into the third window, H = 3; it holds there until killed),
    started again at once: group 0
    syncs alone meanwhile; group 1 takes group 0's state at a sync step's first batch (its masters, inner momentum,
    anchors, outer momentum, the loop's counters) and both end at step 30 with bit-equal parameters. Group 0 pauses
    1 s after each step it takes alone (0.2 s otherwise), so that it still runs when group 1 is back."""
    steps = 30
    args = ["--mode", "ft", "--out", str(tmp_path), "--steps", str(steps), "--diloco", "3", "--opt", "sgd",
            "--record", "--pause", "0.2", "--pause-alone", "1.0", "--resumable"]
    ra, rb, before, _, restarted = _lose_group_one(tmp_path, "ft", args, 7, lambda step: step == 7, "step 7 of group 1")
    assert before == 7, f"killed after step {before}"
    # a record's quorum is its group's last sync's; the committed count moves at sync steps only
    # (group 0 may have joined late itself: its records start at its first step)
    syncs = [(r["step"], r["quorum"]) for r, prev in zip(ra[1:], ra) if r["committed_steps"] != prev["committed_steps"]]
    assert [step for step, _ in syncs] == list(range(ra[0]["step"] + 3 - ra[0]["step"] % 3, steps + 1, 3)), ra
    assert any(q == 1 and step > before for step, q in syncs), syncs  # the survivor synced alone
    rejoined = next(r for r in rb if r["t"] > restarted)
    assert rejoined["step"] > before and rejoined["step"] % 3 == 0 and rejoined["quorum"] == 2, rejoined
    assert ra[-1]["step"] == rb[-1]["step"] == steps and ra[-1]["quorum"] == rb[-1]["quorum"] == 2
    ft0, ft1 = _load(tmp_path / "ft0.pt"), _load(tmp_path / "ft1.pt")
    assert ft0["global_step"] == ft1["global_step"] == steps
    assert _differ(ft0, ft1) == []
    assert ft1["summary"]["recoveries"] >= 1 and ft0["summary"]["participants_min"] == 1, (ft0["summary"],
                                                                                         ft1["summary"])
    assert ft0["summary"]["peers_healed"] >= 1, ft0["summary"]


def test_a_group_lost_with_a_fragment_in_flight_rejoins_at_a_send_step(tmp_path):
    """Streaming (H = 4, two fragments, delay 1, mixing 0.5: sends after odd steps, applies after even ones): group 1
    killed after step 9, its fragment's average in flight, and started again. Group 0 goes on alone (its in-flight
    fragment applied or dropped, whichever the Manager decides) and syncs alone; group 1 joins at a send step's first
    batch (no fragment in flight there) and takes group 0's state; from that step on the two groups' anchors (the
    synced model, per fragment) are bit-equal at every step, though their masters differ (mixing keeps each group's
    local progress), and both end at step 30."""
    steps = 30
    args = ["--mode", "ft", "--out", str(tmp_path), "--steps", str(steps), "--diloco", "4", "--fragments", "2",
            "--delay", "1", "--mixing", "0.5", "--opt", "sgd", "--record", "--pause", "0.2", "--pause-alone", "1.0",
            "--resumable"]
    ra, rb, before, killed, restarted = _lose_group_one(tmp_path, "ft", args, 9, lambda step: step == 9,
                                                        "step 9 of group 1")
    assert before == 9, f"killed after step {before}"
    assert any(r["t"] > killed and r["quorum"] == 1 for r in ra), ra  # the survivor alone
    after = [r for r in rb if r["t"] > restarted]
    rejoined = after[0]
    assert rejoined["step"] > before and rejoined["step"] % 2 == 1, rejoined
    assert after[1]["quorum"] == 2, after[:2]  # its first decision: the apply after the send step it joined at
    assert [r["step"] for r in after] == list(range(rejoined["step"], steps + 1)), after
    survivor = {r["step"]: r for r in ra}
    for r in after:
        assert r["fragment_anchors"] == survivor[r["step"]]["fragment_anchors"], (r, survivor[r["step"]])
    assert after[-1]["fragment_masters"] != survivor[steps]["fragment_masters"]  # the local progress mixing keeps
    assert ra[-1]["step"] == steps and ra[-1]["quorum"] == after[-1]["quorum"] == 2
    s0, s1 = _load(tmp_path / "ft0.pt")["summary"], _load(tmp_path / "ft1.pt")["summary"]
    assert s1["recoveries"] >= 1 and s0["peers_healed"] >= 1 and s0["participants_min"] == 1, (s0, s1)


def test_fabric_two_groups_equal_the_diloco_job_without_fault_tolerance(tmp_path):
    """Fabric's strategy, the loop of ft_trainer.py: 2 groups x 2 ranks, H = 3, accumulation 2, 6 steps, against the
    4-rank Fabric job (s = 2, r = 2) reading the same slices."""
    steps = ["--steps", "6", "--accum", "2", "--opt", "sgd", "--diloco", "3"]
    f0, f1, ref = _two_groups_and_the_job(tmp_path, "fabric", "fabric-mics", steps)
    assert f0["global_step"] == f1["global_step"] == ref["global_step"] == 6
    assert _differ(f0, f1) == [] and _differ(f0, ref) == []
    for s in (f0["summary"], f1["summary"]):  # two outer syncs, both committed with both groups
        assert (s["steps"], s["committed"], s["failed"], s["participants_min"], s["participants_max"],
                s["committed_steps"]) == (2, 2, 0, 2, 2, 2), s


def test_fabric_group_lost_mid_window_rejoins_at_a_sync_with_the_step_count(tmp_path):
    """Under Fabric, group 1 killed one step into a window (H = 3; its first such step from step 4 on: it may have
    joined late itself) and started again: it waits in fabric.setup's quorum until group 0's next sync step, takes
    its state with the inner step count, so its first step is that sync step (quorum 2); both end at step 18
    bit-equal."""
    steps = 18
    args = ["--mode", "fabric", "--out", str(tmp_path), "--steps", str(steps), "--diloco", "3", "--opt", "sgd",
            "--record", "--pause", "0.2", "--pause-alone", "1.0"]
    ra, rb, before, killed, restarted = _lose_group_one(tmp_path, "fabric", args, 4,
                                                        lambda step: step >= 4 and step % 3 == 1,
                                                        "group 1 one step into a window, from step 4 on")
    assert before >= 4 and before % 3 == 1 and before < steps - 6, before
    rejoined = next(r for r in rb if r["t"] > restarted)
    survivor_then = [r["step"] for r in ra if r["t"] < rejoined["t"]]
    assert rejoined["step"] % 3 == 0 and rejoined["step"] > before and rejoined["quorum"] == 2, rejoined
    assert rejoined["step"] - 1 in survivor_then, (rejoined, survivor_then)  # it took the peer's count, not its own
    assert [r["step"] for r in rb if r["t"] > restarted] == list(range(rejoined["step"], steps + 1)), rb
    assert any(r["t"] > killed and r["quorum"] == 1 and r["step"] % 3 == 0 for r in ra), ra  # the survivor alone
    f0, f1 = _load(tmp_path / "fabric0.pt"), _load(tmp_path / "fabric1.pt")
    assert f0["global_step"] == f1["global_step"] == steps
    assert _differ(f0, f1) == []
    assert f1["summary"]["recoveries"] >= 1 and f0["summary"]["peers_healed"] >= 1, (f0["summary"], f1["summary"])
