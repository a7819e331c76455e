"""Jobs launched on several hosts as users launch them: torchrun on each of two hosts, 1 rank per host.

Two network namespaces joined by a veth pair are the hosts ([Note: loopback-range hosts] in tests/helpers/netns.py);
both share this machine's cores and its filesystem (the "shared filesystem" a multi-host job needs). Each host runs
examples/multi_host/torchrun.sh (``torchrun --nnodes 2 --nproc-per-node 1``, c10d rendezvous on the first host, the
job's id) with OMP_NUM_THREADS unset, as a user types it:

- the main job: one run folder named from the id, holding every rank's checkpoint
  shards, each rank's log and the report; the ranks' torch threads split this machine's cores between them
  ([Note: threads per rank] in frontends/threads.py); the default sharding degree (ranks per node: 1) shards
  nothing and the job says so, with what to give; and the result equals the same job on one host under Lightning's
  launcher with the same layout and threads, bit for bit (parameters and optimizer state).
- a Trainer script (examples/multi_host/trainer_script.py, a sharding group spanning both hosts): its folder from
  the job's id with both ranks' shards, and its final parameters bit-equal to the same script on one host;
- a job across hosts whose launcher gives no id: refused on every host before any rank connects.

The namespaces are created and always deleted by the test; where they cannot be created it skips and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import pytest
import torch

from tests.helpers.app import MICS_TINY, TINY, app_env, run_app_forked
from tests.helpers.launch import REPO, free_port
from tests.helpers.netns import HOSTS, namespace_hosts

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "examples" / "multi_host" / "trainer_script.py"
RECIPE = REPO / "examples" / "multi_host" / "torchrun.sh"
THREADS = max(1, len(os.sched_getaffinity(0)) // 2)  # two ranks share this machine's cores
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                "TORCHELASTIC_RUN_ID")


@pytest.fixture
def two_hosts():
    with namespace_hosts("h") as names:
        yield names


def _on_hosts(hosts: Sequence[str], command: Callable[[int], List[str]], extra_env: Callable[[int], Dict[str, str]],
              cwd: Path, timeout: float = 300) -> Tuple[List[object], List[str]]:
    """``command(node)`` in each host, from the same folder, OMP_NUM_THREADS unset; returns each host's exit
    status and output once both ended (both killed at ``timeout``)."""
    procs = []
    for node, ns in enumerate(hosts):
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME=ns, **extra_env(node))
        log = open(cwd / f"host{node}.log", "w+")
        procs.append((subprocess.Popen(["ip", "netns", "exec", ns, *command(node)], env=env, cwd=cwd, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    codes: List[object] = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            codes.append("timeout")
    outs = []
    for _, log in procs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    return codes, outs


def _recipe_on_hosts(hosts: Sequence[str], job: str, command: List[str], cwd: Path) -> List[str]:
    """examples/multi_host/torchrun.sh (torchrun, c10d rendezvous on the first host) in each host with ``command``;
    returns each host's output, both having succeeded."""
    port = free_port()
    codes, outs = _on_hosts(hosts, lambda node: ["bash", str(RECIPE), *command], lambda node: dict(
        HEAD=HOSTS[0], HOSTS="2", RANKS_PER_HOST="1", JOB_ID=job, PORT=str(port),
        TORCHRUN=f"{sys.executable} -m torch.distributed.run",
        LOCAL_ADDR=HOSTS[node]), cwd)  # hosts in namespaces share a hostname: each says its address
    assert codes == [0, 0], "\n".join(f"--- host {i} (exit {c}) ---\n{t[-5000:]}" for i, (c, t) in
                                      enumerate(zip(codes, outs)))
    return outs


def _state(ckpt: Path) -> Dict[str, torch.Tensor]:
    import lightning_mics

    full = lightning_mics.consolidate(ckpt)
    flat = {f"param/{k}": v for k, v in full["state_dict"].items()}
    for i, opt in enumerate(full["optimizer_states"]):
        for pid, state in opt["state"].items():
            flat.update({f"opt{i}/{pid}/{k}": torch.as_tensor(v) for k, v in state.items()})
    return flat


def _assert_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, [(k, (a[k].double() - b[k].double()).abs().max().item()) for k in differ[:5]]


def test_main_job_on_two_hosts_is_the_job_on_one(two_hosts, tmp_path: Path) -> None:
    args = [*TINY, *MICS_TINY, "trainer.max_steps=12"]
    args.remove("trainer.devices=2")  # the launcher's: 1 per host, 2 hosts
    shared = tmp_path / "shared"
    shared.mkdir()
    _recipe_on_hosts(two_hosts, "job7", ["-m", "lightning_mics.app.train", *args], shared)

    folders = sorted(p.relative_to(shared).as_posix() for p in (shared / "outputs").iterdir())
    assert folders == ["outputs/torchrun-job7"], folders  # one folder for the job, from its id
    run = shared / "outputs" / "torchrun-job7"
    assert sorted(p.name for p in (run / "checkpoints" / "last.ckpt").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]  # both hosts' shards in it
    for name in (".job", ".hydra", "train.log", "train_rank1.log", "report.json", "report.md", "csv"):
        assert (run / name).exists(), name
    rank0, rank1 = (run / "train.log").read_text(), (run / "train_rank1.log").read_text()
    assert "[launch] torchrun started 2 ranks on 2 hosts (1 per host); trainer.devices=1 trainer.num_nodes=2 from " \
           "the launcher; the job's id from torchrun --rdzv-id=job7" in rank0, rank0[-3000:]
    cores = len(os.sched_getaffinity(0))
    for rank, text in ((0, rank0), (1, rank1)):
        assert f"[rank {rank}] torch threads: {THREADS} ({cores} cores shared by 2 ranks of this job on this " \
               "machine; OMP_NUM_THREADS was not set)" in text, text[-3000:]
    assert "MiCSStrategy: no parameter is sharded: sharded_data_parallel_degree=1 (None: the ranks per node, 1) on " \
           "2 nodes of 1 rank, so every rank holds the whole model (1.00x), as with DDP. Give " \
           "sharded_data_parallel_degree=2 (allowed: a divisor of the world size 2, [2])" in rank0, rank0[-3000:]
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 12 and report["world_size"] == 2

    # the same job on one host, Lightning's launcher, the same layout (s = 1, r = 2) and threads per rank
    one = tmp_path / "one"
    env = dict(app_env(), OMP_NUM_THREADS=str(THREADS), PYTHONPATH=str(REPO))
    proc = run_app_forked([*args, "trainer.devices=2", "strategy.sharded_data_parallel_degree=1",
                           f"hydra.run.dir={one}"], cwd=tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    _assert_equal(_state(one / "checkpoints" / "last.ckpt"), _state(run / "checkpoints" / "last.ckpt"))
    alone = json.loads((one / "report.json").read_text())
    assert alone["val_loss_history"] == report["val_loss_history"]  # validation loss at each check, exactly


def test_trainer_script_on_two_hosts_is_the_script_on_one(two_hosts, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    outs = _recipe_on_hosts(two_hosts, "job8", [str(SCRIPT), "--shard", "2", "--steps", "12"], shared)
    run = shared / "runs" / "torchrun-job8"
    assert sorted(p.name for p in (shared / "runs").iterdir()) == ["torchrun-job8"]
    assert sorted(p.name for p in (run / "last.ckpt").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                     "meta.pt"]
    assert "[trainer_script] 2 ranks, 12 steps; wrote runs/torchrun-job8" in outs[0], outs[0][-3000:]
    both = outs[0] + outs[1]
    for rank in (0, 1):
        assert f"[rank {rank}] torch threads: {THREADS} (" in both, both[-3000:]
    assert "MiCS layout: world=2 s=2 r=1 ranks_per_node=1" in both, both[-3000:]  # the group spans both hosts

    one = tmp_path / "one"
    one.mkdir()
    env = dict(app_env(), OMP_NUM_THREADS=str(THREADS), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--devices", "2", "--shard", "2", "--steps", "12",
                           "--run-id", "alone"], cwd=one, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    a = torch.load(one / "runs" / "alone" / "final.pt", weights_only=True)
    b = torch.load(run / "final.pt", weights_only=True)
    _assert_equal(a, b)


def test_a_job_across_hosts_without_an_id_is_refused(two_hosts, tmp_path: Path) -> None:
    """A static rendezvous without --rdzv-id: torchrun gives its ranks no job id, so the hosts could not name one
    folder; every rank refuses before it connects, with the fix, and nothing is written. The first host's rank says
    it; the other host's says it too unless its agent ends it first (it stops its ranks once the first host's agent,
    which holds the rendezvous, is gone), so only the first host's words are awaited."""
    port = str(free_port())
    codes, outs = _on_hosts(two_hosts, lambda node: [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
        str(node), "--master-addr", HOSTS[0], "--master-port", port, "-m", "lightning_mics.app.train",
        "trainer.max_steps=2"], lambda node: {}, tmp_path, timeout=240)
    assert all(c not in (0, "timeout") for c in codes), (codes, outs)
    said = "torchrun started 2 ranks on 2 hosts without a job id (torchrun without --rdzv-id), so the hosts " \
           "cannot name one run folder for the job. Give torchrun --rdzv-id=<the job's id, the same on every host>, " \
           "or give the job run_id=<name>."
    assert said in outs[0], outs[0][-3000:]
    assert not (tmp_path / "outputs").exists()
