"""A real two-host run: two network namespaces joined by a veth pair act as two nodes of 2 ranks each.

Each namespace has its own network stack; the only link between them is the veth pair, addressed with a
loopback-range /30 (127.200.0.1 <-> 127.200.0.2; [Note: loopback-range hosts] in tests/helpers/netns.py). ``torchrun --nnodes 2
--nproc-per-node 2`` starts 2 ranks in each (static rendezvous on the first host's address); gloo binds to the
veth (``GLOO_SOCKET_IFNAME``), so every byte between the hosts crosses it. The strategy is given no
``ranks_per_node``: it takes the node size from Lightning's cluster environment (torchelastic's), so s = 4 spans
both hosts and the parameter all-gather runs in two hops (inter-host, then intra-host). Parameters after 4
optimizer steps (accumulation 2) must match one plain process on the same global batches (tests/engine/equiv.py).

The namespaces are created and always deleted by the test; where they cannot be created (not root, no
CAP_NET_ADMIN, no ``ip``), it skips and says why.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.launch import REPO
from tests.helpers.netns import HOSTS, namespace_hosts
from tests.engine.test_equivalence import _assert_matches

pytestmark = pytest.mark.distributed



@pytest.fixture
def two_hosts():
    with namespace_hosts("m") as names:
        yield names


def test_two_hosts_match_one_process(two_hosts, tmp_path):
    port = "29517"
    procs = []
    for node, ns in enumerate(two_hosts):
        out = tmp_path / f"node{node}"
        out.mkdir()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                   GLOO_SOCKET_IFNAME=ns)
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", HOSTS[0], "--master-port", port,
               str(REPO / "tests" / "engine" / "equiv.py"), "--out", str(tmp_path),
               "--variants", '[{"s": 4}]', "--steps", "4", "--accum", "2", "--count", "--num-nodes", "2"]
        log = open(out / "log.txt", "w+")
        procs.append((subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=540))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            codes.append("timeout")
    logs = []
    for _, log in procs:
        log.seek(0)
        logs.append(log.read())
    assert codes == [0, 0], "\n".join(f"--- host {i} (exit {c}) ---\n{t[-5000:]}" for i, (c, t) in
                                      enumerate(zip(codes, logs)))
    res = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(4)]
    # the layout Lightning's cluster environment gave: 2 ranks per node, s = 4 over both hosts
    assert "MiCS layout: world=4 s=4 r=1 ranks_per_node=2" in logs[0], logs[0][-3000:]
    for r in res:
        assert "error" not in r["variants"][0], r["variants"][0].get("error")
        assert r["global_step"] == 4
    _assert_matches(res[0], rtol=1e-5, atol=1e-7)
    # two hops: rank 0 gathers first across hosts with rank 2 (same local rank), then inside its host with rank 1;
    # never one flat gather over the 4 ranks
    gathers = {tuple(g) for batch in res[0]["comms"] for op, g, _ in batch if op == "all_gather"}
    assert (0, 2) in gathers and (0, 1) in gathers and (0, 1, 2, 3) not in gathers, gathers
