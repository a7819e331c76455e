"""A bad strategy option in a real job: the process exits non-zero within 60 s with a message naming the option,
the value and what is allowed, every rank alike, before any collective.

The refusals that need no process (every value and combination ``MiCSStrategy.__init__`` refuses, and those
checked when the Trainer or Fabric is made: ``validate_world``, the precision check) are rows of one in-process
table, test_refusals.py beside this file. Here two of its rows run as a user's script (``bad_input.py`` with
``devices=2`` as one process, forked from the test launcher's server that has imported Lightning,
``tests/helpers/launch.py``): the process exits with the message and never starts the second rank. The others
need a process: those that need the model (a ``shard_units`` or ``activation_checkpointing`` class the model does
not contain or has already wrapped in torch's ``checkpoint_wrapper``, a checkpoint group longer than the run of
blocks, a fused optimizer whose kernel DTensor has no rule for, Lightning's SWA, EMA and pruning callbacks) are
refused at setup: both ranks raise the same error before the first collective of the engine, and both exit (each
rank's line is in the output). Two of them start as a user's ``python bad_input.py`` does (rank 0 forked from the
launcher's server, rank 1 started by Lightning's launcher), the others with both ranks started as torchrun would
(forked, each with its own log). Two run under ``torchrun`` itself (2 ranks, every rank
refuses before the process group: a degree that does not divide the world, and ``devices`` not matching
torchrun's world size), and two through the Hydra app (``python -m lightning_mics.app.train strategy.X=...``).
The 60 s bound is the specification, not a figure.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import REPO, free_port, start

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests" / "options" / "bad_input.py"
BOUND_S = 60

# (id, how it is started, options (JSON for the script; overrides for the app), extra arguments,
#  substrings the output must hold: the option with its value, then what is allowed)
INIT, SETUP, RANKS, TORCHRUN, APP = "init", "setup", "ranks", "torchrun", "app"
CASES = [
    # two of test_refusals.py's rows as a user's job: refused in MiCSStrategy.__init__, and when the Trainer is made
    ("degree-zero", INIT, {"sharded_data_parallel_degree": 0}, [],
     ["sharded_data_parallel_degree=0", "allowed is an integer >= 1 or None"]),
    ("degree-not-dividing-world", INIT, {"sharded_data_parallel_degree": 3}, [],
     ["sharded_data_parallel_degree=3", "allowed is a divisor of the world size 2: [1, 2]"]),
    # refused on every rank: at setup (they need the model; SETUP: Lightning's launcher starts rank 1, RANKS: both
    # ranks started as torchrun would), or under torchrun before the process group
    ("shard-units-not-in-model", SETUP, {"shard_units": ["torch.nn.TransformerEncoderLayer"]}, [],
     ["shard_units=['TransformerEncoderLayer']", "allowed is classes of modules in the model"]),
    ("checkpointing-not-in-model", RANKS, {"activation_checkpointing": ["torch.nn.TransformerEncoderLayer"]}, [],
     ["activation_checkpointing=['torch.nn.TransformerEncoderLayer']", "contains no instance of"]),
    ("group-longer-than-run", RANKS, {"activation_checkpointing": ["tests.helpers.models.Block"],
                                      "checkpoint_group_size": 3}, [],
     ["checkpoint_group_size=3", "allowed: 1..2"]),
    ("checkpointing-wrapped-blocks", RANKS, {"activation_checkpointing": ["tests.helpers.models.Block"]},
     ["--wrapped-blocks"],  # the user's own checkpoint_wrapper around each block: Lightning's FSDP ignores its option
     ["activation_checkpointing=['tests.helpers.models.Block']", "already checkpoints", "Allowed: this option "
      "without the wrappers, or the wrappers with activation_checkpointing=None"]),
    ("pruning-callback", SETUP, {}, ["--pruning"],  # Lightning's pruning callback
     ["callbacks not supported: ModelPruning (it replaces each pruned parameter", "Allowed: none of these."]),
    ("swa-zero1-bf16-mixed", RANKS, {"sharded_data_parallel_degree": 1, "shard_optimizer_state": True},
     ["--swa", "--precision", "bf16-mixed"],  # as EMA's below
     ["StochasticWeightAveraging with the optimizer-state-only layout", "torch.bfloat16 copies of the fp32 masters",
      "Allowed: a '-true' precision ('32-true', 'bf16-true')"]),
    ("ema-zero1-bf16-mixed", RANKS, {"sharded_data_parallel_degree": 1, "shard_optimizer_state": True},
     ["--ema", "--precision", "bf16-mixed"],  # the average would be swapped through ZeRO-1's bf16 copies
     ["EMAWeightAveraging with the optimizer-state-only layout", "torch.bfloat16 copies of the fp32 masters",
      "Allowed: a '-true' precision ('32-true', 'bf16-true')"]),
    ("fused-sgd", RANKS, {}, ["--fused-sgd"],  # the user's optimizer: a fused kernel DTensor has no rule for
     ["SGD(fused=True) cannot step the sharded parameters", "aten._fused_sgd_", "Allowed: SGD(foreach=True)"]),
    ("torchrun-degree-not-dividing-world", TORCHRUN, {"sharded_data_parallel_degree": 4}, [],
     ["sharded_data_parallel_degree=4", "allowed is a divisor of the world size 2: [1, 2]"]),
    ("torchrun-devices-not-world", TORCHRUN, {}, ["--devices", "4"],
     ["devices=4", "does not match the world size (2)"]),
    # through the Hydra app: a wrong value (MiCSStrategy.__init__), a wrong type (the structured config)
    ("app-kernels-x", APP, ["strategy.kernels=x"], [], ["kernels='x'", "allowed is 'auto' | 'triton' | 'torch'"]),
    ("app-prefetch-string", APP, ["strategy.prefetch=abc"], [],
     ["strategy.prefetch", "'abc'", "could not be converted to Integer"]),
]


def _job_pids(marker: str):
    """Processes whose command line holds ``marker`` (the case's own folder)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if marker.encode() in cmd:
                pids.append(int(d))
    return pids


def _script_args(options, extra, out):
    return ["--out", str(out), "--strategy", json.dumps(options), *extra]


def _command(kind, options, extra, out):
    if kind == APP:
        return [sys.executable, "-m", "lightning_mics.app.train", *options, "trainer.devices=2",
                "trainer.max_steps=2", f"hydra.run.dir={out}/hydra"]
    args = [str(SCRIPT), *_script_args(options, extra, out)]
    if kind == TORCHRUN:  # torchrun ends the other ranks (SIGTERM) at its first look after one fails (every 0.1 s
        # by default): a rank behind under load is ended before it refuses (5 s was too short once, in a fresh
        # clone's run beside another job). Looking every 10 s lets every rank show its own refusal, which is
        # what this table checks; the job still ends within 10 s of it.
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "10",
                "--master-port", str(free_port()), *args]
    return [sys.executable, *args]


def _every_rank(env, args, out):
    """Both ranks as torchrun would start them (forked from the launcher's server, each its own log): each must exit
    non-zero within the bound, having printed its refusal. Returns their logs."""
    env = dict(env, MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", NODE_RANK="0")
    procs = [start(SCRIPT, args, dict(env, RANK=str(r), LOCAL_RANK=str(r)), out, out / f"rank{r}.log") for r in (0, 1)]
    deadline = time.monotonic() + BOUND_S
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    logs = [(out / f"rank{r}.log").read_text() for r in (0, 1)]
    for r, (code, log) in enumerate(zip(codes, logs)):
        assert code is not None, f"rank {r} still running after {BOUND_S} s:\n{log[-4000:]}"
        assert code != 0 and f"[rank {r}] refused: ValueError: " in log, log[-4000:]
    return "\n".join(logs)


@pytest.mark.parametrize("kind,options,extra,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_naming_option_value_and_allowed(tmp_path, kind, options, extra, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), MASTER_PORT=str(free_port()),
               HYDRA_FULL_ERROR="1")
    log = tmp_path / "job.log"
    began = time.monotonic()
    if kind == RANKS:
        output = _every_rank(env, _script_args(options, extra, tmp_path), tmp_path)
    elif kind in (INIT, SETUP):  # rank 0 forked from the launcher's server; under SETUP Lightning starts rank 1
        proc = start(SCRIPT, _script_args(options, extra, tmp_path), env, tmp_path, log)
    else:
        with open(log, "w") as f:
            proc = subprocess.Popen(_command(kind, options, extra, tmp_path), cwd=tmp_path, env=env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    if kind != RANKS:
        try:
            code = proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            code = None
            if kind in (INIT, SETUP):
                proc.kill()
                for pid in _job_pids(str(tmp_path)):  # the rank Lightning started
                    os.kill(pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)  # and what it started (its own session)
            proc.wait()
        if kind in (SETUP, TORCHRUN):  # a rank the launcher started may print its refusal after rank 0 has ended
            deadline = time.monotonic() + 10
            while _job_pids(str(tmp_path)) and time.monotonic() < deadline:
                time.sleep(0.2)
        output = log.read_text()
        assert code is not None, f"still running after {BOUND_S} s:\n{output[-4000:]}"
        assert code != 0, output[-4000:]
    for text in expected:
        assert text in output, f"{text!r} not in the output:\n{output[-4000:]}"
    assert "fit finished" not in output
    if kind in (SETUP, RANKS, TORCHRUN):  # every rank refused, alike, and exited
        for rank in (0, 1):
            assert f"[rank {rank}] refused: ValueError: " in output, output[-4000:]
        if kind != TORCHRUN:  # a failure on every rank: the store's host (rank 0) waited for every rank to see it
            assert "TCPStore" not in output, output[-4000:]
        assert not _job_pids(str(tmp_path)), f"a rank was left running\n{output[-4000:]}"
        assert time.monotonic() - began < BOUND_S, f"the last rank ended after {time.monotonic() - began:.0f} s"
    if kind == INIT:
        assert "[rank 0] refused: " in output and "[rank 1]" not in output  # refused before any launch
