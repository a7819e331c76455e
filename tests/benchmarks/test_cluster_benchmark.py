"""benchmarks/cluster.py: its plumbing in seconds, and one small real run on two hosts.

The plumbing tests need nothing but this process: the command line, the arithmetic that turns counter samples
into bytes per step, the summary and ratios over the runs' records, the table and the plot, the collective clock
on a one-rank gloo group. The real run starts the benchmark as a user does (two network namespaces, a shaped veth,
``torchrun`` on each host, a tiny GPT, two cases) and checks what it wrote against itself and against physics:
bytes the collectives must move, counted three independent ways (the veth's counters, the clock's wrapper, the
strategy's telemetry). Like tests/layout/test_two_hosts.py it skips, saying why, only where namespaces cannot be made
(not root, no CAP_NET_ADMIN, no ``ip``); the benchmark's modules are imported unconditionally.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.launch import REPO, free_port

sys.path.insert(0, str(REPO / "benchmarks"))
import cluster  # noqa: E402
import cluster_rank  # noqa: E402
import twohosts  # noqa: E402


# -- command line ------------------------------------------------------------------------------------------------
def test_arguments_defaults_and_refusals():
    a = cluster.parse_args([])
    assert a.rates == [100.0, 400.0, 0.0] and a.accum == [1, 4] and a.cases == list(cluster_rank.CASES)
    assert (a.width, a.layers, a.vocab, a.warmup) == (384, 8, 8192, 1)
    a = cluster.parse_args(["--rates", "50", "0", "--accum", "2", "--rounds", "3", "--steps", "5",
                            "--cases", "ddp", "mics_host", "--width", "64"])
    assert (a.rates, a.accum, a.rounds, a.steps, a.cases, a.width) == ([50.0, 0.0], [2], 3, 5, ["ddp", "mics_host"], 64)
    for bad in (["--warmup", "0"], ["--rates", "-1"], ["--accum", "0"], ["--cases", "fsdp1"]):
        with pytest.raises(SystemExit):
            cluster.parse_args(bad)


# -- link counters ---------------------------------------------------------------------------------------------
def test_net_dev_counters_are_the_sysfs_ones():
    """/proc/net/dev (what the benchmark reads from outside a namespace) carries the device's own counters: a
    sysfs read lies between two /proc reads (loopback traffic of other processes only moves them forward)."""
    before = twohosts.parse_net_dev(Path("/proc/self/net/dev").read_text(), "lo")
    sysfs = [int(Path(f"/sys/class/net/lo/statistics/{k}_bytes").read_text()) for k in ("rx", "tx")]
    after = twohosts.parse_net_dev(Path("/proc/self/net/dev").read_text(), "lo")
    assert before[0] <= sysfs[0] <= after[0] and before[1] <= sysfs[1] <= after[1]
    with pytest.raises(KeyError):
        twohosts.parse_net_dev(Path("/proc/self/net/dev").read_text(), "no-such-if")


class _Counting:
    """A counter source: each read returns the next pair."""

    def __init__(self):
        self.reads = 0

    def counters(self):
        self.reads += 1
        return 1000 * self.reads, 10 * self.reads ** 2


def test_step_marks_read_the_counters_when_rank0_asks(tmp_path):
    source = _Counting()
    with twohosts.StepMarks(source, tmp_path / "s") as marks:
        conn = None
        for step in (1, 2, 3, 4):
            conn = twohosts.ask_mark(str(tmp_path / "s"), step, conn)
            assert source.reads == step  # answered only once read
        conn.close()
    assert marks.marks == {1: (1000, 10), 2: (2000, 40), 3: (3000, 90), 4: (4000, 160)}
    assert twohosts.per_step(marks.marks, 2, 4) == [(1000, 30), (1000, 50), (1000, 70)]
    assert twohosts.per_step(marks.marks, 4, 4, before=1) == [(3000, 150)]  # the window's ends only
    assert not (tmp_path / "s").exists()
    with twohosts.StepMarks(source, tmp_path / "s") as marks:  # nobody connects: the exit does not hang
        pass
    assert marks.marks == {}
    assert twohosts.tbf_args(100)[:3] == ["tbf", "rate", "100mbit"]
    assert int(twohosts.tbf_args(1600)[4]) == 1600e6 / 8 * 0.004 and int(twohosts.tbf_args(10)[4]) == 65536


# -- the collective clock ----------------------------------------------------------------------------------------
def test_comm_clock_counts_bytes_calls_and_blocked_time(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    clock = cluster_rank.CommClock(ranks_per_host=1)
    clock.install()
    try:
        t = torch.ones(1000)
        dist.all_reduce(t)
        work = dist.all_reduce(torch.ones(10), async_op=True)
        out = torch.empty(64)
        dist.all_gather_single(out, torch.ones(64))
        assert "all_reduce/local" in clock.window and clock.window["all_reduce/local"][:2] == [2, 4040]
        before = clock.window["all_reduce/local"][2]
        work.wait()
        assert clock.window["all_reduce/local"][2] >= before  # the wait is added to the blocked time
        assert not clock._pending
        window = clock.take()
        assert window["all_gather_single/local"] == dict(calls=1, bytes=256, wait_s=window["all_gather_single/local"]
                                                         ["wait_s"])
        assert clock.take() == {}  # reset
    finally:
        clock.uninstall()
        dist.destroy_process_group()
    assert dist.all_reduce is torch.distributed.distributed_c10d.all_reduce


# -- summary, ratios, table, plot ------------------------------------------------------------------------------
def _record(case, rate, durations, link, waits, rnd=0):
    """A run record as cluster.run_one writes it: 4 ranks, warmup 1; ``durations[k][r]`` the timed step k of rank
    r (the 0.01 s handshake after each step end left out); ``waits[k][r]`` its cross-host all-reduce wait; a
    warm-up window with a huge wait that must not count."""
    ranks = []
    for r in range(4):
        ends = [100.0]
        for d in durations:
            ends.append(ends[-1] + 0.01 + d[r])
        comm = [{"all_reduce/cross": dict(calls=1, bytes=8, wait_s=1e6)}]
        comm += [{"all_reduce/cross": dict(calls=1, bytes=8, wait_s=w[r]),
                  "all_gather_single/local": dict(calls=3, bytes=16, wait_s=0.5)} for w in waits]
        ranks.append(dict(ends=ends, resumes=[e + 0.01 for e in ends], comm=comm))
    return dict(case=case, rate_mbit=rate, accum=1, warmup=1, load=[1.0 + rnd, 0, 0], n_params=10, ranks=ranks,
                telemetry={"comm/all_reduce/replicate/bytes": 8.0, "mem/x": 1.0}, link_steps=link, round=rnd,
                probe_mbit=95.0)


def test_summary_ratios_and_table(tmp_path):
    recs = [
        _record("ddp", 100.0, [[1, 2, 3, 4], [1, 1, 1, 2]], [[10e6, 9e6], [12e6, 9e6]], [[1, 1, 1, 1], [2, 2, 2, 2]]),
        _record("ddp", 100.0, [[1, 1, 1, 6]], [[11e6, 8e6]], [[3, 3, 3, 3]], rnd=1),
        _record("mics_host", 100.0, [[1, 1, 1, 1], [3, 1, 1, 1]], [[5e6, 6e6], [5e6, 6e6]], [[0, 0, 0, 4], [0] * 4]),
        dict(case="mics_host", rate_mbit=100.0, accum=1, error="exit [1, 0]", load=[9.0, 0, 0]),
    ]
    rows = {r["case"]: r for r in cluster.summarize(recs)}
    ddp, mics = rows["ddp"], rows["mics_host"]
    assert ddp["step_s"] == pytest.approx(4) and ddp["steps"] == 3 and ddp["rounds"] == 2
    assert ddp["step_s_rounds"] == pytest.approx([3, 6])
    assert ddp["link_bytes_dirs"] == [11e6, 9e6] and ddp["link_bytes"] == 11e6
    assert ddp["floor_s"] == pytest.approx(11e6 * 8 / 100e6)
    assert ddp["step_over_floor"] == pytest.approx(4 / ddp["floor_s"])
    assert ddp["ar_wait_s"] == 2 and ddp["comm_wait_s"] == 2 and ddp["load1"] == [1.0, 2.0]
    assert ddp["counted"]["all_gather_single/local"] == dict(bytes=16, calls=3)
    assert mics["step_s"] == pytest.approx(2) and mics["ar_wait_s"] == 0.5
    assert mics["rounds"] == 1  # the failed run left out
    assert mics["telemetry"] == {"comm/all_reduce/replicate/bytes": 8.0}
    assert ddp["best_peer"] == mics["best_peer"] == "ddp" and ddp["vs_best_peer"] == 1
    assert mics["vs_best_peer"] == pytest.approx(0.5)
    assert mics["vs_fsdp2_full"] is None and mics["bytes_vs_hsdp"] is None
    for row in rows.values():  # the JSON line the issue asks for
        assert {"case", "rate_mbit", "accum", "step_s", "link_bytes"} <= set(json.loads(json.dumps(row)))
    text = cluster.table(list(rows.values()))
    assert "| 100 Mbit/s | 1 | mics_host | 2.00 | 2.00 | 0.50 | — | 6.0 | — | 0.48 | 4.17 | 0.50 | 0.50 | 1.0-1.0 |" \
        in text
    assert "| 100 Mbit/s | 1 | ddp | 4.00 | 3.00 / 6.00 | 1.00 |" in text
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [r["case"] for r in cluster.report(folder, "cmd")] == ["ddp", "mics_host"]
    md = (folder / "table.md").read_text()
    assert "Failed runs:" in md and "exit [1, 0]" in md and "DeepSpeed" in md and "`cmd`" in md
    assert (folder / "cluster.png").stat().st_size > 0
    assert [json.loads(x)["case"] for x in (folder / "rows.jsonl").read_text().splitlines()] == ["ddp", "mics_host"]


def test_the_step_after_the_window_mark_is_not_timed():
    """Records with marks at the window's ends only (``timed_from``): the first step after the warm-up followed
    the handshake, so neither its time nor its waits count; the later ones do, as the slowest rank's mean (rank 0's
    long step 3 and rank 1's long step 4 are not both counted)."""
    rec = _record("mics_host_os", 100.0, [[0.5] * 4, [3, 1, 1, 1], [1, 2, 1, 1]], [[5e6, 6e6]],
                  [[9, 9, 9, 9], [1, 1, 1, 1], [3, 3, 3, 3]])
    rec["timed_from"] = 3
    row = cluster.summarize([rec])[0]
    assert row["steps"] == 2 and row["step_s"] == pytest.approx(2) and row["ar_wait_s"] == 2
    del rec["timed_from"]  # a record from before: every timed step counts
    row = cluster.summarize([rec])[0]
    assert row["steps"] == 3 and row["step_s"] == pytest.approx(2) and row["ar_wait_s"] == 3  # max per step: 0.5, 3, 2


def test_diloco_windows_ratios_and_table():
    """[Note: DiLoCo's timed window] in benchmarks/cluster.py: a DiLoCo case times k x H steps, refuses a warm-up
    that makes the untimed step a sync step; its row holds the sync counts and bytes per sync, its ratios the best
    exact case (the MiCS ones too) and the same case on the unshaped link."""
    blocking = ["--cases", "ddp", "mics_host_diloco", "mics_host_diloco_q8"]
    a = cluster.parse_args(["--sync-every", "4", "--windows", "2", "--steps", "3", *blocking])
    assert [cluster.case_steps(c, a) for c in ("ddp", "mics_host_diloco", "mics_host_diloco_q8")] == [3, 8, 8]
    for bad in (["--sync-every", "4", "--warmup", "3"], ["--windows", "0"], ["--sync-every", "0"]):
        with pytest.raises(SystemExit):
            cluster.parse_args([*bad, *blocking])
    cluster.parse_args(["--sync-every", "4", "--warmup", "3", "--cases", "ddp"])  # no DiLoCo case: no sync to miss
    recs = [_record("fsdp2_hsdp", 100.0, [[4] * 4], [[10e6, 10e6]], [[1] * 4]),
            _record("mics_host_q8", 100.0, [[2] * 4], [[3e6, 3e6]], [[1] * 4]),
            _record("mics_host_diloco", 100.0, [[1] * 4] * 2 + [[3] * 4, [1] * 4], [[6e6, 5e6]], [[0] * 4] * 4),
            _record("mics_host_diloco", 0.0, [[1] * 4] * 4, [[6e6, 5e6]], [[0] * 4] * 4)]
    for rec in recs:
        rec["timed_from"] = 2  # every step below timed
    for rec in recs[2:]:
        rec.update(sync_every=4, windows=1)
    rows = {(r["case"], r["rate_mbit"]): r for r in cluster.summarize(recs)}
    dl = rows[("mics_host_diloco", 100.0)]
    assert dl["step_s"] == pytest.approx(1.5) and dl["syncs_timed"] == 1 and dl["link_window_steps"] == 5
    assert dl["link_bytes_per_sync"] == pytest.approx(30e6)  # 6 MB per step over the 5 steps of the link's window
    # timed steps 2..5, the sync at step 4 (H = 4): the third timed step
    assert (dl["inner_step_s"], dl["sync_step_s"], dl["vs_inner"]) == pytest.approx((1, 3, 1.5))
    recs[2]["outer_steps"] = [0, 0, 0, 1, 1]  # the engine's counter (syncs by each step's end) says the same
    assert cluster.summarize(recs)[2]["sync_step_s"] == pytest.approx(3)
    recs[2]["outer_steps"] = [0, 0, 0, 0, 1]  # where it says so, the counter decides: then step 5 synced
    assert cluster.summarize(recs)[2]["sync_step_s"] == pytest.approx(1)
    assert dl["best_exact"] == "mics_host_q8" and dl["vs_best_exact"] == pytest.approx(0.75)
    assert dl["best_peer"] == "fsdp2_hsdp" and dl["vs_best_peer"] == pytest.approx(0.375)
    assert dl["vs_unshaped"] == pytest.approx(1.5) and rows[("mics_host_diloco", 0.0)]["vs_unshaped"] == 1
    assert rows[("fsdp2_hsdp", 100.0)]["best_exact"] == "mics_host_q8"
    text = cluster.diloco_table(list(rows.values()))
    assert "| 100 Mbit/s | 1 | mics_host_diloco | 4 | 1.50 | mics_host_q8 (2.00) | 0.75 | fsdp2_hsdp | 0.38 | 1.50 " \
        "| 1.00 | 3.00 | 1.50 | 6.0 | 30.0 |" in text
    assert [line.split(" | ")[2] for line in text.splitlines()[2:]] == ["mics_host_diloco"] * 2  # DiLoCo rows only



def test_streaming_diloco_windows_refusals_and_strategy():
    """[Note: DiLoCo's timed window] with streaming fragments (two, delay 1): a window of H steps holds one sync per
    fragment; a warm-up whose last step or the untimed step after it sends or applies a fragment's sync is refused,
    and so is an H the fragments do not divide; the row counts both syncs and bytes per fragment's sync; the case's
    strategy is DiLoCo's with the quality grid's streaming settings."""
    import cluster_rank

    assert cluster_rank.syncs_per_window("mics_host_diloco_stream") == 2
    assert cluster_rank.syncs_per_window("mics_host_diloco_q8") == 1
    stream = ["--cases", "mics_host_diloco_stream"]
    a = cluster.parse_args(["--sync-every", "16", "--warmup", "1", *stream])  # P = 8: sends after 7, 15; applies 8, 16
    assert cluster.case_steps("mics_host_diloco_stream", a) == 16
    for bad in (["--warmup", "6"], ["--warmup", "7"], ["--warmup", "8"], ["--sync-every", "3"],
                ["--sync-every", "2", "--warmup", "2"],  # 3, and 1 step per fragment: none inner
                ["--sync-delay", "3", "--warmup", "4"], ["--sync-delay", "8"]):  # step 5 sends; 8 >= H / 2
        with pytest.raises(SystemExit):
            cluster.parse_args(["--sync-every", "16", *bad, *stream])
    cluster.parse_args(["--sync-every", "16", "--warmup", "7", "--cases", "mics_host_diloco"])  # blocking: no sync at 8
    rec = _record("mics_host_diloco_stream", 100.0, [[3] * 4, [1] * 4, [3] * 4, [1] * 4], [[6e6, 5e6]], [[0] * 4] * 4)
    rec.update(timed_from=2, sync_every=4, windows=1, outer_steps=[0, 1, 1, 2, 2])  # P = 2: applies after 2 and 4
    [row] = cluster.summarize([rec])
    assert row["syncs_timed"] == 2 and row["link_bytes_per_sync"] == pytest.approx(15e6)  # 6 MB x 5 steps over 2
    assert (row["inner_step_s"], row["sync_step_s"]) == pytest.approx((1, 3))
    del rec["outer_steps"]  # without the counter: the multiples of P = H / 2
    assert cluster.summarize([rec])[0]["sync_step_s"] == pytest.approx(3)
    strategy = cluster_rank.make_strategy("mics_host_diloco_stream_q8", None, sync_every=16)
    keys = ("replica_sync", "sync_every", "quantize_gradients", *cluster_rank.STREAMING)
    got = {k: getattr(strategy.config, k) for k in keys}
    assert got == {"replica_sync": "diloco", "sync_every": 16, "quantize_gradients": True, **cluster_rank.STREAMING}
    cluster.parse_args(["--sync-every", "16", "--sync-delay", "3", "--warmup", "1", *stream])  # sends after 5, 13
    assert cluster_rank.make_strategy("mics_host_diloco_stream", None, 16, sync_delay=3).config.sync_delay == 3


# -- one small real run on two hosts --------------------------------------------------------------------------------
def _namespaces_or_skip():
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("two-host benchmark: `ip` and `tc` (iproute2) are needed")
    name = f"cbt{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"two-host benchmark: cannot create a network namespace here ({r.stderr.strip()}); "
                    "it needs root or CAP_NET_ADMIN")
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.distributed
def test_small_real_run_on_two_hosts(tmp_path):
    _namespaces_or_skip()
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "benchmarks" / "cluster.py"), "--rates", "50", "--accum", "2", "--rounds", "1",
           "--steps", "2", "--cases", "ddp", "mics_host", "--width", "64", "--layers", "2", "--heads", "2",
           "--vocab", "512", "--seq", "32", "--batch", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    made = (out / "namespaces.txt").read_text().split()
    assert len(made) == 2 and not set(made) & set(listed)  # the benchmark's namespaces are gone
    records = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert [r.get("error") for r in records] == [None, None]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines == cluster.summarize(records)  # what it printed is what its records say
    rows = {r["case"]: r for r in lines}
    ddp, mics = rows["ddp"], rows["mics_host"]
    for r in lines:
        assert (r["rate_mbit"], r["accum"], r["steps"]) == (50.0, 2, 2)
        assert r["floor_s"] == pytest.approx(r["link_bytes"] * 8 / 50e6)
        assert r["ar_wait_s"] > 0 and 0 < r["probe_mbit"] <= 50
    assert ddp["vs_best_peer"] == 1 and mics["vs_best_peer"] == pytest.approx(mics["step_s"] / ddp["step_s"])
    # mics_host: the replica all-reduce of each rank's half of the fp32 model between its two hosts: each of a
    # host's 2 ranks must send at least its half, so each direction carries at least the whole model per step
    model = mics["n_params"] * 4
    assert min(mics["link_bytes_dirs"]) >= model, (mics["link_bytes_dirs"], model)
    # the clock's wrapper and the strategy's telemetry count the same cross-host all-reduces
    counted = mics["counted"]["all_reduce/cross"]["bytes"]
    tele = mics["telemetry"]
    assert counted == tele["comm/all_reduce/replicate/bytes"] + tele.get("comm/all_reduce/world/bytes", 0)
    assert counted >= model / 2
    # DDP's all-reduce over 4 ranks moves more across the link than MiCS's per-host groups
    assert ddp["counted"]["all_reduce/cross"]["bytes"] >= model and ddp["link_bytes"] > mics["link_bytes"]
    assert "| 50 Mbit/s | 2 | mics_host |" in (out / "table.md").read_text() and (out / "cluster.png").exists()


def test_link_probe_sees_the_shaped_rate(tmp_path):
    """benchmarks/link_probe.py on two fresh hosts at 50 Mbit/s: every pattern reports, no stream beats the shaper
    (the tbf bucket lets at most 64 KiB through ahead of the rate), and its namespaces are gone afterwards."""
    _namespaces_or_skip()
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "link_probe.py"), "--rate", "50", "--mbytes", "2"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [(r["streams"], r["both_directions"], len(r["secs"])) for r in rows] == [(1, False, 1), (1, True, 2),
                                                                                  (2, False, 1), (2, True, 2)]
    for r in rows:
        assert r["floor_s"] == pytest.approx(2e6 * 8 / 50e6)
        assert all(s >= (2e6 - 65536) * 8 / 50e6 for s in r["secs"]), r
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert after <= before
