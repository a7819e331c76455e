"""replica_sync="diloco" under the Trainer: 4 real gloo ranks, s = 2 (two replica groups) and s = 1 (four), a small
residual MLP (tests/diloco/diloco_ranks.py), each run against a single-process simulation of the same algorithm.

- H = 1 with outer SGD at lr 1 and no momentum equals exact sync and one plain process on the same global batches;
- H = 3 with Nesterov momentum (two outer steps), accumulation 2 with clipping (H = 2), and s = 1 (pure replication,
  H = 2) equal the simulation (the replica groups' inner loops in turn, the same outer step) to fp32 rounding;
- int8 pseudo-gradients stay within the bound of [Note: the int8 outer bound] (diloco_ranks.py) of the simulation,
  and the quantization did act;
- under bf16-mixed (the outer step on the fp32 masters), blocking and streaming, within three times exact sync's
  own bf16 distance from its fp32 simulation;
- nothing crosses the replica groups inside a window: one all-reduce (int8: an all-to-all and an all-gather) on the
  replica group at each sync step, none at the others (the dispatcher's count); exact sync has one per unit per step;
- streaming fragments ([Note: streaming fragments] in lightning_mics/engine/fragments.py): F = 2 and 3, a delay of
  one step with fragment_mixing 0.5 (a fragment still in flight when the run ends), equal the simulation to fp32
  rounding; one fragment's all-reduce per sync step, of that fragment's elements only; int8 fragments in flight
  within the derived bound on the fragment synced, the other untouched;
- with every collective finishing late (exact-window DiLoCo, streaming with a delay, int8 in flight) every rank's
  parameters equal its prompt run bit for bit ([Note: late collectives] in tests/helpers/late_collectives.py).
"""

import json

import pytest
import torch

from tests.helpers.launch import REPO, run_ranks

RANKS = REPO / "tests" / "diloco" / "diloco_ranks.py"
pytestmark = pytest.mark.distributed

PLAIN_OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}
VARIANTS = [
    {"steps": 3},  # exact sync
    {"steps": 3, "replica_sync": "diloco", "sync_every": 1, **PLAIN_OUTER},
    {"steps": 6, "replica_sync": "diloco", "sync_every": 3},  # the defaults: Nesterov, lr 0.7, momentum 0.9
    {"steps": 4, "accum": 2, "clip": 0.05, "replica_sync": "diloco", "sync_every": 2},
    {"steps": 3, "replica_sync": "diloco", "sync_every": 3, "quantize_gradients": True, "quantization_block_size": 32},
    {"steps": 4, "s": 1, "replica_sync": "diloco", "sync_every": 2},
    {"steps": 4, "precision": "bf16-mixed"},  # exact sync under bf16-mixed: the yardstick of bf16's rounding
    {"steps": 4, "precision": "bf16-mixed", "replica_sync": "diloco", "sync_every": 2},
    # streaming: 8 F = 2 blocking; 9 a delay and mixing, fragment 1 in flight at the end; 10 F = 3 with a delay;
    # 11 int8 in flight (fragment 0 sent after step 1, applied after step 2: the run's only outer step)
    {"steps": 6, "replica_sync": "diloco", "sync_every": 4, "sync_fragments": 2},
    {"steps": 7, "replica_sync": "diloco", "sync_every": 4, "sync_fragments": 2, "sync_delay": 1,
     "fragment_mixing": 0.5},
    {"steps": 6, "replica_sync": "diloco", "sync_every": 6, "sync_fragments": 3, "sync_delay": 1},
    {"steps": 2, "replica_sync": "diloco", "sync_every": 4, "sync_fragments": 2, "sync_delay": 1,
     "fragment_mixing": 0.5, "quantize_gradients": True, "quantization_block_size": 32},
    # 12 streaming under bf16-mixed: both fragments in flight for a step, mixed, applied to the fp32 masters
    {"steps": 4, "precision": "bf16-mixed", "replica_sync": "diloco", "sync_every": 4, "sync_fragments": 2,
     "sync_delay": 1, "fragment_mixing": 0.5},
]
STREAMING = [8, 9, 10, 11]
LATE = [2, 9, 11]  # run again with every collective 30 ms late: exact-window DiLoCo, streaming, int8 in flight
FP32 = 1e-6  # parameters are O(0.1-1); the runs and the simulation round differently by a few ulps at most
U = 2.0 ** -24


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("diloco")
    res = run_ranks(RANKS, 4, ["--variants", json.dumps(VARIANTS), "--late", *map(str, LATE), "--planted", "9"], out)
    return sorted(res, key=lambda r: r["rank"])


def _replica(v, rank):
    return rank // v.get("s", 2) if v.get("replica_sync") == "diloco" else 0


def _distance(runs, k):
    """Per rank: max |run - simulation| of that rank's replica, for variant k."""
    v, sim = VARIANTS[k], runs[0]["sims"][k]["params"]
    return [(torch.tensor(r["runs"][k]["params"]) - torch.tensor(sim[_replica(v, r["rank"])])).abs().max().item()
            for r in runs]


def test_h1_plain_outer_sgd_equals_exact_sync_and_one_plain_process(runs):
    plain = torch.tensor(runs[0]["sims"][0]["params"][0])  # one process, the global batches
    for r in runs:
        exact, diloco = torch.tensor(r["runs"][0]["params"]), torch.tensor(r["runs"][1]["params"])
        assert (exact - plain).abs().max().item() <= FP32
        assert (diloco - plain).abs().max().item() <= FP32
        assert (diloco - exact).abs().max().item() <= FP32
    h1 = torch.tensor(runs[0]["sims"][1]["params"][0])  # the simulation of H = 1 with plain outer SGD
    assert (h1 - plain).abs().max().item() <= FP32
    moved = (plain - torch.tensor(runs[0]["sims"][2]["params"][0])).abs().max().item()
    assert moved > 1e-3  # the other variants' trajectories are not this one (the comparison has power)


@pytest.mark.parametrize("k", [2, 3, 5], ids=["h3_nesterov", "accum2_clip_h2", "s1_h2"])
def test_equals_the_single_process_simulation(runs, k):
    assert max(_distance(runs, k)) <= FP32, _distance(runs, k)
    sim = runs[0]["sims"][k]["params"]
    # the replicas end equal (the last step is a sync step), and DiLoCo is not exact sync on these batches
    assert all(torch.equal(torch.tensor(p), torch.tensor(sim[0])) for p in sim)
    exact_like = torch.tensor(runs[0]["sims"][1]["params"][0])
    assert (torch.tensor(sim[0]) - exact_like).abs().max().item() > 1e-3
    if VARIANTS[k].get("clip"):
        assert runs[0]["sims"][k]["clipped"] >= 4  # clipping acted in at least half of the 8 replica steps


def test_int8_pseudo_gradients_within_the_derived_bound(runs):
    k = 4
    v, sim = VARIANTS[k], runs[0]["sims"][k]
    r = len(sim["pseudo_inf"])
    mu = 0.9
    bound = 0.7 * (1 + mu) * (2 / 254 + (r + 6) * U) * sum(sim["pseudo_inf"]) / r  # [Note: the int8 outer bound]
    dist = _distance(runs, k)
    assert max(dist) <= bound + FP32, (dist, bound)
    assert min(dist) > 10 * FP32, dist  # the quantization did act
    assert bound < 0.05  # and the bound says something (parameters are O(0.1-1))
    # every rank of a shard rank agrees bit for bit after the int8 sync (the all-gather delivers the same rows)
    assert runs[0]["runs"][k]["params"] == runs[2]["runs"][k]["params"]


def test_bf16_mixed_outer_step_on_the_fp32_masters(runs):
    """The same algorithm under bf16-mixed: the forward and backward round to bf16, which the fp32 simulation does not
    model; that rounding is measured on exact sync (its distance to its own fp32 simulation) and DiLoCo's distance to
    its simulation may be at most three times it. The replica groups end bit-equal (the last step is a sync step)."""
    exact_bf16 = max(_distance(runs, 6))
    diloco_bf16 = max(_distance(runs, 7))
    assert 0 < exact_bf16 < 0.05 and diloco_bf16 <= 3 * exact_bf16 + FP32, (exact_bf16, diloco_bf16)
    assert runs[0]["runs"][7]["params"] == runs[2]["runs"][7]["params"]
    assert runs[1]["runs"][7]["params"] == runs[3]["runs"][7]["params"]


def test_bf16_mixed_streaming_fragments_on_the_fp32_masters(runs):
    """Streaming under bf16-mixed (variant 12: two fragments, each in flight for one inner step and mixed at 0.5), as
    many steps as the bf16 yardstick (variant 6): within three times exact sync's bf16 distance from its fp32
    simulation, and the replica groups did not end equal (the mixing keeps each group's progress made in flight)."""
    exact_bf16 = max(_distance(runs, 6))
    streaming_bf16 = max(_distance(runs, 12))
    assert 0 < exact_bf16 < 0.05 and streaming_bf16 <= 3 * exact_bf16 + FP32, (exact_bf16, streaming_bf16)
    sim = runs[0]["sims"][12]["params"]
    assert (torch.tensor(sim[0]) - torch.tensor(sim[1])).abs().max().item() > 1e-3
    for a, b in ((0, 1), (2, 3)):  # the ranks of one replica group hold the same model
        assert runs[a]["runs"][12]["params"] == runs[b]["runs"][12]["params"]


def test_nothing_crosses_the_replica_groups_inside_a_window(runs):
    for r in runs:
        exact = r["runs"][0]["replica_traffic"]
        assert all(len(batch) == 3 and {op for op, _ in batch} == {"all_reduce"} for batch in exact)  # 3 units
        for k in (1, 2, 3, 4, 5, 7):
            v = VARIANTS[k]
            accum, every = v.get("accum", 1), v["sync_every"]
            for b, batch in enumerate(r["runs"][k]["replica_traffic"]):
                step_end = (b + 1) % accum == 0
                sync = step_end and ((b + 1) // accum) % every == 0
                want = (["all_to_all", "all_gather"] if v.get("quantize_gradients") else ["all_reduce"]) if sync else []
                assert [op for op, _ in batch] == want, (k, b, batch)


def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path):
    """A sharded checkpoint after step 3 (one step into a window, H = 2) resumed to step 6 ends where the
    uninterrupted run ends, on every rank, bit for bit: each replica's masters and inner momentum, the anchors, the
    outer momentum and the step count came back ([Note: DiLoCo in checkpoints]). The same with streaming fragments
    (H = 4, F = 2, a delay of one step, mixing 0.5): saved after step 3 with fragment 1's all-reduce in flight, its
    average saved and applied after step 4 of the resumed run."""
    res = sorted(run_ranks(REPO / "tests" / "diloco" / "diloco_resume.py", 4, [], tmp_path), key=lambda r: r["rank"])
    for r in res:
        for name, inside, in_flight in (("window", 1, None), ("streaming", 3, 1)):
            c = r[name]
            assert c["whole"]["step"] == c["resumed"]["step"] == 6 and c["first"]["step"] == 3
            assert c["first"]["steps_at_save"] == inside  # saved inside a window
            assert c["first"]["in_flight_at_save"] == in_flight
            assert c["resumed"]["params"] == c["whole"]["params"], (name, r["rank"])
    for name in ("window", "streaming"):
        # the replica groups held different masters at the save: one shared copy would not have resumed this run
        assert res[0][name]["first"]["at_save"] != res[2][name]["first"]["at_save"]


def test_fabric_loop_equals_the_simulation_and_resumes_exactly(tmp_path):
    """Under Fabric (no_backward_sync, accumulation 2, fabric.clip_gradients, H = 2): the loop equals the
    single-process simulation; fabric.save after step 3 and fabric.load into a new model and optimizer continue it
    bit for bit. The same with streaming fragments (H = 4, F = 2, delay 1, mixing 0.5: fragment 1 in flight at the
    save)."""
    res = sorted(run_ranks(REPO / "tests" / "diloco" / "diloco_fabric.py", 4, [], tmp_path), key=lambda r: r["rank"])
    for name in ("window", "streaming"):
        sim = res[0][name]["sim"]
        assert sim["clipped"] >= 4
        for r in res:
            mine = torch.tensor(r[name]["loop"]) - torch.tensor(sim["params"][r["rank"] // 2])
            assert mine.abs().max().item() <= FP32, (name, r["rank"])
            assert r[name]["resumed"] == r[name]["loop"], (name, r["rank"])
    assert res[0]["streaming"]["loop"] != res[0]["window"]["loop"]


def test_main_job_config_takes_diloco():
    """``strategy.replica_sync=diloco`` and the outer options compose through the main job's structured config (the
    schema types them) into a MiCSStrategy that holds them; a wrong type fails at compose."""
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException
    from hydra.utils import instantiate

    from lightning_mics.app.train import CONF_MODULE

    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "strategy.sharded_data_parallel_degree=2", "strategy.replica_sync=diloco", "strategy.sync_every=4",
            "strategy.outer_lr=0.5", "strategy.quantize_gradients=true", "strategy.sync_fragments=2",
            "strategy.sync_delay=1", "strategy.fragment_mixing=0.5"])
        with pytest.raises(ConfigCompositionException):
            compose(config_name="config", overrides=["strategy.sync_every=often"])
    strategy = instantiate(cfg.strategy)
    o = strategy.options
    assert (o.replica_sync, o.sync_every, o.outer_lr, o.outer_momentum, o.outer_nesterov, o.quantize_gradients) == \
        ("diloco", 4, 0.5, 0.9, True, True)
    assert (o.sync_fragments, o.sync_delay, o.fragment_mixing) == (2, 1, 0.5)


def _frags(v):
    return v.get("sync_fragments", 1), v.get("sync_every", 1) // v.get("sync_fragments", 1), v.get("sync_delay", 0)


@pytest.mark.parametrize("k", [8, 9, 10], ids=["f2", "f2_delay1_mixing", "f3_delay1"])
def test_streaming_fragments_equal_the_single_process_simulation(runs, k):
    assert max(_distance(runs, k)) <= FP32, _distance(runs, k)
    from tests.diloco.diloco_ranks import FRAGMENTS

    for r in runs:  # the cut the simulation assumes is the engine's
        assert r["runs"][k]["fragments"] == [sorted(f) for f in FRAGMENTS[_frags(VARIANTS[k])[0]]]
    # the comparison has power: the fragments' run is neither exact-window DiLoCo nor the replicas' own training
    sim = runs[0]["sims"][k]["params"]
    assert (torch.tensor(sim[0]) - torch.tensor(sim[1])).abs().max().item() > 1e-3  # not synced at the end
    whole = torch.tensor(runs[0]["sims"][2]["params"][0])
    assert (torch.tensor(sim[0]) - whole).abs().max().item() > 1e-3


def test_streaming_sends_one_fragment_per_sync_step(runs):
    """The dispatcher's count: one all-reduce on the replica group at each fragment's send step, of that fragment's
    elements (fp32) on this rank; none at the other steps. int8: the all-to-all at the send, the all-gather at the
    apply (gloo issues a chain's second collective when it is waited for). The fragments hold the whole shard."""
    for r in runs:
        whole = r["runs"][2]["replica_traffic"][2]  # exact-window DiLoCo: the whole shard's all-reduce
        assert [op for op, _ in whole] == ["all_reduce"]
        for k in STREAMING:
            v, run = VARIANTS[k], r["runs"][k]
            F, period, delay = _frags(v)
            numels = run["fragment_numels"]
            assert len(numels) == F and sum(numels) * 4 == whole[0][1] and max(numels) < sum(numels)
            if F == 2:
                assert max(numels) <= 0.6 * sum(numels), numels  # about half the bytes per sync
            for b, batch in enumerate(run["replica_traffic"]):
                n = b % v["sync_every"] + 1
                sent = (n + delay) // period - 1 if (n + delay) % period == 0 else None
                applied = n % period == 0
                if v.get("quantize_gradients"):
                    want = (["all_to_all"] if sent is not None else []) + (["all_gather"] if applied else [])
                    assert [op for op, _ in batch] == want, (k, b, batch)
                else:
                    want = [] if sent is None else [["all_reduce", numels[sent] * 4]]
                    assert batch == want, (k, b, batch)


def test_int8_fragment_in_flight_within_the_derived_bound(runs):
    """Variant 11: fragment 0 (head, block 0) is sent in int8 after step 1 and applied after step 2, the run's only
    outer step: its parameters are within [Note: the int8 outer bound] (diloco_ranks.py) of the simulation (the
    mixing only scales the error by 1 - alpha), and fragment 1 (block 1), never synced, equals it to fp32 rounding."""
    k = 11
    sim = runs[0]["sims"][k]
    r = len(sim["pseudo_inf"])
    bound = 0.7 * (1 + 0.9) * (2 / 254 + (r + 6) * U) * sum(sim["pseudo_inf"]) / r
    from tests.diloco.diloco_ranks import build

    names = [n for n, _ in build().named_parameters()]
    sizes = [p.numel() for p in build().parameters()]
    in_block1 = torch.cat([torch.full((n,), name.startswith("blocks.1.")) for name, n in zip(names, sizes)])
    for run in runs:
        mine = torch.tensor(sim["params"][_replica(VARIANTS[k], run["rank"])])
        diff = (torch.tensor(run["runs"][k]["params"]) - mine).abs()
        assert diff[~in_block1].max().item() <= bound + FP32, (diff[~in_block1].max().item(), bound)
        assert diff[~in_block1].max().item() > 10 * FP32  # the quantization did act
        assert diff[in_block1].max().item() <= FP32
    assert bound < 0.05


def test_late_collectives_leave_every_rank_bit_equal(runs):
    """Exact-window DiLoCo, streaming with a delay (the fragment's all-reduce in flight across an inner step, one
    still in flight when fit ends) and int8 in flight, each run again with every collective finishing 30 ms after
    it was issued: every rank's parameters equal its prompt run bit for bit, with the same replica traffic. An
    average read before its ``wait()`` would hold the unreduced pseudo-gradient there."""
    for r in runs:
        for k in LATE:
            late, prompt = r["late"][str(k)], r["runs"][k]
            assert sum(late["late_issued"].values()) > 0
            assert late["params"] == prompt["params"], (k, r["rank"])
            assert late["replica_traffic"] == prompt["replica_traffic"], (k, r["rank"])


def test_a_fragment_read_before_its_wait_is_caught(runs):
    """The late device can fail a streaming run: with the replica group's collectives a second late (a slow link),
    variant 9 as it is still equals its prompt run bit for bit, and the same run with its fragments' averages read
    where they apply without waiting (diloco_ranks.py's average_read_unwaited) does not: it steps the anchors with
    this replica's own pseudo-gradient."""
    for r in runs:
        honest, planted, prompt = r["slow"]["honest"], r["slow"]["planted"], r["runs"][9]
        assert honest["params"] == prompt["params"], r["rank"]
        assert planted["params"] != prompt["params"], r["rank"]


def test_fragments_cut_and_schedule():
    """[Note: streaming fragments] in lightning_mics/engine/fragments.py, in this process: the units' cut (consecutive,
    nonempty, each cut nearest its share; more fragments than units refused naming the option), and the schedule:
    each fragment sent and applied once per window, tau steps apart, at most one in flight, the last at the window's
    end; F = 1 with no delay is the sync after every H-th step."""
    from lightning_mics.engine.fragments import applies_after, sent_after, split_units

    assert split_units([24, 202, 202], 2) == [[0, 1], [2]]
    assert split_units([24, 202, 202], 3) == [[0], [1], [2]]
    assert split_units([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_units([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match=r"sync_fragments=4 is invalid: allowed is an integer in \[1, 3\]"):
        split_units([24, 202, 202], 4)
    for H, F in ((16, 1), (16, 4), (12, 3), (8, 8)):
        for tau in range(H // F):
            in_flight, seen = None, []
            for n in range(1, H + 1):
                sent = sent_after(n, H, F, tau)
                if sent is not None:
                    assert in_flight is None
                    in_flight = sent
                    seen.append((sent, n))
                if in_flight is not None and n == applies_after(in_flight, H, F):
                    assert n == seen[-1][1] + tau
                    in_flight = None
            assert [f for f, _ in seen] == list(range(F)) and in_flight is None
            assert applies_after(F - 1, H, F) == H
    assert [n for n in range(1, 17) if sent_after(n, 16, 1, 0) is not None] == [16]
