"""What a GPU has to show before the strategy is called ready for one, in one call: a JSON line per check.

    python benchmarks/gpu_ready.py                                   # one CUDA device, about 7 minutes
    python benchmarks/gpu_ready.py --out-dir "$OUT"                  # the lines where a lent machine sends back
    python benchmarks/gpu_ready.py --accelerator cpu --small         # every check that runs on CPU, reduced

Appends to ``<out-dir>/gpu_ready_<device>.jsonl`` (``<device>``: a slug of ``torch.cuda.get_device_name``,
``h100``, ``h200``; ``cpu`` on CPU) one line per check, printed as it is written: ``commit`` (``git rev-parse
--short HEAD``, ``+dirty`` with changes; ``--commit`` where the copy has no .git), ``check``, ``ok`` (the verdict
against the check's target: true / false, null where the check cannot decide on this device, with ``reason``),
``device``, ``at`` (the run's start, UTC, shared by its lines), ``wall_s`` and the check's figures. Each check runs
in its own process group with its own timeout; one that fails, crashes or runs out of time writes ``ok: false`` and
its log's last lines (``error``), and the next one starts. ``--budget`` (seconds, default 480) bounds the whole run:
a check gets at most what is left of it (``--timeout CHECK=SECONDS`` sets one check's own limit). ``--keep DIR`` keeps
every check's logs (the ranks' too) and result files.

Checks (lines in the order they end: ``sanitizer``, the longest, starts first and runs beside the checks that time
nothing, ``offload_dropout``, ``sync_debug`` and ``table_builds``; the timed ones, ``triton_small_bucket`` and
``single_gpu_overhead``, run alone after it):

- ``offload_dropout``: ``tests/helpers/offload_check.offload_dropout_check(device)``: a stack of blocks with
  ``Dropout(0.5)``, checkpointed in groups of 2 with offload on and off (and not checkpointed), two passes from the
  same seeds; the gradients and the RNG states (the CPU's and the device's) after backward bit-equal. Target: equal.
- ``sync_debug``: Fabric, one GPU, GPT (4 x 256) under bf16-mixed, four loops (s = 1; ZeRO-1; grouped checkpointing
  with offload; accumulation 2 with clipping by norm, ``error_if_nonfinite=False``), batches already on the device,
  no ``item()``: after 3 warm-up steps, 3 steps under ``torch.cuda.set_sync_debug_mode("warn")`` (each synchronizing
  call counted, with its site) and 2 under ``"error"``. Target: zero syncs. Where tests/helpers/host_reads.py exists
  its ``HostReads`` also attributes the host's reads of tensor data (engine / outside). On CPU: ``ok`` null; the same
  loops run (tiny GPT) and the host reads are the figure.
- ``table_builds``: ``lightning_mics_kernels.table_stats()`` (descriptor tables built, [Note: descriptor tables]) after
  warm-up: (a) the four bucket copies and int8 quantize / dequantize called directly on a small bucket set with new
  inputs each call (as the engine's gradients are) and outputs as views of one buffer; (b) the engine: 4 ranks,
  ``kernels="triton"``, s = 2 (r = 2) in fp32 and under bf16-mixed with int8 error feedback, accumulation 2,
  clipping; 2 warm-up steps, then 3 (with --small: 2 ranks, fp32, 2 steps). Target: 0 builds after warm-up (and
  lookups > 0: the kernels ran). On CPU under TRITON_INTERPRET=1; on CUDA the ranks share the GPU, their
  collectives over gloo on host copies as in ``sanitizer``.
- ``triton_small_bucket``: benchmarks/kernels.py at a 1 MB bucket (flatten, scatter, chunk_cat, chunk_split; fp32
  and fp32->bf16; 10 and 100 tensors; inputs rotated over 3 copies, outputs views of one buffer, as the engine calls
  them): Triton's time against torch's best (``vs torch``; >1 is faster). Target: the smallest ``vs torch`` >= 1.0.
  On CPU: ``ok`` null (the interpreter's times say nothing); the outputs are checked bit for bit at a 64 KB bucket.
- ``single_gpu_overhead``: GPT-2 124M, bf16-mixed, batch 8 x 1024, 20 steps after 10, each case in its own
  process, ``--rounds`` (3) interleaved rounds: the bare loop, ``Trainer(strategy=MiCSStrategy())`` (both from
  benchmarks/single_gpu.py), and under Fabric MiCS and Fabric's own ``FSDPStrategy`` (auto-wrapping each Block),
  the same loop. Figure: tokens/s over the bare loop's, the median over rounds of each round's ratio. Target:
  Trainer and Fabric MiCS >= 0.97 (0.90 on an H200, 0.94 median on an H100 before). On CPU: ``ok`` null (tiny GPT,
  no FSDP).
- ``sanitizer``: ``TORCH_CUDA_SANITIZER=1`` (CSAN: a CUDA kernel reading or writing a tensor that another stream
  used without synchronization raises), ``kernels="torch"`` (CSAN cannot see inside Triton's launches),
  deterministic algorithms. Three launches at once on the one GPU:
  (1) ``trainer``: 4 ranks, the Trainer layouts of tests/comm/test_late_collectives.py (FP32: prefetch 2, two-hop,
  keep-gathered, live cap, int8 with error feedback, int8 gather hop, rows over replicas with accumulation, ZeRO-1,
  grouped checkpointing with offload, stop_on_nonfinite), each trained with prompt collectives and with every
  collective 30 ms late (tests/helpers/late_collectives.py); (2) ``fabric``: 4 ranks, its six Fabric loops the same
  way; (3) ``one``: one process on NCCL, s = 1 layouts whose CUDA streams need no peer (s = 1, ZeRO-1, grouped
  checkpointing with offload on its side stream, fp32 and bf16-mixed; Trainer and Fabric), prompt only (its figure:
  each layout's largest difference from the same front end and precision's s = 1 run). One GPU
  gives NCCL one rank, and gloo on CUDA tensors segfaults in the engine's gathers (benchmarks/LOG.md), so in
  (1) and (2) the model and every kernel are on the GPU and each collective runs over gloo on host copies:
  ``HostCollectives`` below, a dispatch mode of this script (the engine has no such path) copies the tensors to the
  host at issue (a synchronizing copy on the issuing stream) and the results back at ``wait()`` on the waiting
  stream. Target: clean (no CSAN report, no error; in (3) a finite state) and, in (1) and (2), the late run's full
  state equal to the prompt one's bit for bit; and the arrangement's self-test: the first Trainer case once more
  with a unit's all-gather output read before its ``wait()`` (tests/comm/late_early_read.py's defect) must end
  elsewhere (``self_test.caught``). ``covers`` names the cases that ran clean and equal, ``not_covered`` what this
  arrangement cannot show. On CPU: ``ok`` null; ``--sanitizer-dry-run`` runs the same machinery on CPU (no CSAN,
  host copies forced; with --small 2 ranks and a few cases: what tests/benchmarks/test_gpu_ready.py checks).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # tests.helpers; gpu_checks, single_gpu, kernels

ORDER = ("offload_dropout", "sanitizer", "sync_debug", "table_builds", "single_gpu_overhead", "triton_small_bucket")
TIMEOUT = {"offload_dropout": 60, "sync_debug": 90, "table_builds": 120, "triton_small_bucket": 90,
           "single_gpu_overhead": 240, "sanitizer": 270}
TIMED = {"triton_small_bucket": 50, "single_gpu_overhead": 170}  # run alone, after the rest; their usual seconds
TARGET = {"single_gpu_overhead": 0.97, "triton_small_bucket": 1.0}
BLOCK = "lightning_mics.app.models.gpt.Block"
LATE = 0.03  # seconds: as tests/comm/test_late_collectives.py
SANITIZER_PARTS = ("trainer", "fabric", "one")
NOT_COVERED = [
    "NCCL's own stream ordering between ranks: one GPU gives NCCL one rank, so the multi-rank cases run their "
    "collectives over gloo on host copies, synchronizing the issuing stream at each issue (which also orders every "
    "stream's earlier work before it, so a race across a collective's issue is not seen there)",
    "the Triton kernels' reads and writes (kernels='torch': CSAN sees only dispatched ops)",
    "the side stream of chained collectives (collectives.side_stream: NCCL only)",
]


# -- small helpers ---------------------------------------------------------------------------------------------
def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA GeForce RTX 4090`` -> ``rtx4090``, ``cpu`` -> ``cpu``."""
    words = [w for w in re.findall(r"[a-z0-9]+", name.lower()) if w not in ("nvidia", "geforce", "tesla", "amd")]
    model = next((w for w in words if re.search(r"[a-z]", w) and re.search(r"\d", w)), None)
    return model or "".join(words[:2]) or "unknown"


def commit_id() -> str:
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
    except Exception:  # noqa: BLE001  (a copy of the tree without .git)
        return "unknown"
    try:
        return head + ("+dirty" if git("status", "--porcelain") else "")
    except Exception:  # noqa: BLE001
        return head


def tail(text: str, lines: int = 12, chars: int = 2500) -> str:
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])[-chars:]


def cuda(args) -> bool:
    return args.accelerator == "cuda"


def deterministic(args) -> None:
    import torch

    import gpu_checks

    gpu_checks.deterministic(args.accelerator)
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without one warns (counted), not fails


def child_env(args, sanitizer: bool = False) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               TRITON_INTERPRET="0" if cuda(args) else "1", CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTHONUNBUFFERED="1")
    env.pop("TORCH_CUDA_SANITIZER", None)  # torch enables CSAN when the name is set at all
    if sanitizer and cuda(args):
        env["TORCH_CUDA_SANITIZER"] = "1"
    return env


# -- collectives over gloo on host copies ---------------------------------------------------------------------------
_IN_PLACE = {"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_"}  # the first argument is read too


def host_collectives(every: bool = False):
    """``HostCollectives``: every c10d collective (and functional collective) on device tensors runs on host copies
    of them, over whatever backend the group has for the host (gloo). At issue the inputs are copied to the host
    (``Tensor.to("cpu")``: on the issuing stream, which that copy synchronizes) and the collective is issued on the
    copies; the returned Work's ``wait()`` waits for it, then copies the results into the device outputs on the
    waiting thread's current stream. So the device outputs hold nothing new before ``wait()``, as on NCCL, and
    ``LateCollectives`` (entered first, beneath this mode) delays the host collectives. ``every``: host tensors are
    copied too (to new host tensors): the same path on CPU. Functional collectives complete at issue (their
    ``wait_tensor`` is then a no-op). ``routed`` / ``unrouted`` count the ops per name."""
    import torch
    import torch.distributed as dist
    import torch.utils._pytree as pytree
    from torch._C._distributed_c10d import PythonCallbackWork
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostCollectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.routed: Dict[str, int] = {}
            self.unrouted: Dict[str, int] = {}

        def _moves(self, t: Any) -> bool:
            return isinstance(t, torch.Tensor) and (every or t.device.type != "cpu")

        def _host(self, t: Any, content: bool) -> Any:
            if not self._moves(t):
                return t
            return t.detach().to("cpu", copy=True) if content else torch.empty_like(t, device="cpu")

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace not in ("c10d", "_c10d_functional", "_dtensor"):
                return func(*args, **kwargs)
            name = func._schema.name.split("::")[-1]
            if name == "wait_tensor" or not any(self._moves(t) for t in pytree.tree_leaves((args, kwargs))):
                return func(*args, **kwargs)
            if func.namespace == "_dtensor":  # not routed: reported, then run as it is
                self.unrouted[name] = self.unrouted.get(name, 0) + 1
                return func(*args, **kwargs)
            self.routed[name] = self.routed.get(name, 0) + 1
            if func.namespace == "_c10d_functional":
                return self._functional(func, name, args, kwargs)
            first = pytree.tree_map(lambda t: self._host(t, name in _IN_PLACE), args[0])
            rest, kw = pytree.tree_map(lambda t: self._host(t, True), (list(args[1:]), kwargs))
            res = func(first, *rest, **kw)
            inner = res[1] if isinstance(res, tuple) else res
            pairs = [(d, h) for d, h in zip(pytree.tree_leaves(args[0]), pytree.tree_leaves(first)) if d is not h]
            done = [False]

            def finish(timeout=None) -> bool:
                if not done[0]:
                    done[0] = True
                    (dist.Work.unbox(inner) if isinstance(inner, torch.ScriptObject) else inner).wait()
                    with torch.no_grad():
                        for d, h in pairs:
                            d.copy_(h)
                return True

            work = PythonCallbackWork(finish).boxed()
            return (args[0], work) if isinstance(res, tuple) else work

        def _functional(self, func, name, args, kwargs):
            device = next(t.device for t in pytree.tree_leaves((args, kwargs)) if self._moves(t))
            h_args, h_kwargs = pytree.tree_map(lambda t: self._host(t, True), (list(args), kwargs))
            res = func(*h_args, **h_kwargs)
            for t in pytree.tree_leaves(res):
                if isinstance(t, torch.Tensor):
                    torch.ops._c10d_functional.wait_tensor(t)
            if name.endswith("_"):  # in place: into the first argument
                with torch.no_grad():
                    for d, h in zip(pytree.tree_leaves(args[0]), pytree.tree_leaves(h_args[0])):
                        if d is not h:
                            d.copy_(h)
                return args[0]
            return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, res)

    return HostCollectives()


class Modes:
    """LateCollectives (if ``late``) beneath HostCollectives (if ``host``): entered and left in order."""

    def __init__(self, host: bool, every: bool, late: float) -> None:
        from tests.helpers.late_collectives import LateCollectives

        self.late = LateCollectives(late) if late else None
        self.host = host_collectives(every) if host else None

    def __enter__(self) -> "Modes":
        for m in (self.late, self.host):
            if m is not None:
                m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.host is not None:
                self.host.__exit__(*exc)
        finally:
            if self.late is not None:
                self.late.__exit__(*exc)


def _add(total: Dict[str, int], more: Optional[Dict[str, int]]) -> None:
    for k, v in (more or {}).items():
        total[k] = total.get(k, 0) + v


# -- ranks ------------------------------------------------------------------------------------------------------
class Ranks:
    """``world`` fresh interpreters of this script's ``--worker``, one "node" each (LOCAL_RANK 0: all on the one
    device), torchrun-style variables; logs and results under ``scratch``."""

    def __init__(self, args, worker: str, world: int, extra: List[str], sanitizer: bool = False,
                 tag: Optional[str] = None) -> None:
        from tests.helpers.launch import free_port

        env = dict(child_env(args, sanitizer), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(world), LOCAL_RANK="0", OMP_NUM_THREADS="1")  # ranks share the host's cores
        cmd = [sys.executable, __file__, "--worker", worker, "--accelerator", args.accelerator, "--scratch",
               args.scratch, *(["--small"] if args.small else []), *extra]
        self.name, self.logs, self.procs = tag or worker, [], []
        for r in range(world):
            log = Path(args.scratch) / f"{self.name}.{r}.log"
            self.logs.append(log)
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(r), NODE_RANK=str(r),
                                                                 GROUP_RANK=str(r)), stdout=f,
                                                   stderr=subprocess.STDOUT))

    def finish(self, deadline: float) -> str:
        """'' when every rank exits 0; else the first failure's log tail. A failing rank ends the others."""
        while time.time() < deadline:
            codes = [p.poll() for p in self.procs]
            if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
                break
            time.sleep(0.2)
        failed = next((r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)), None)
        timed_out = any(p.poll() is None for p in self.procs)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if failed is not None:
            rcs = [p.returncode for p in self.procs]
            return f"{self.logs[failed].name} (rc per rank {rcs}): {tail(self.logs[failed].read_text())}"
        if timed_out:
            return f"{self.name}: out of time; rank 0: {tail(self.logs[0].read_text(), 4)}"
        return ""


_RANK, _WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))  # read once: a Trainer's
# teardown deletes WORLD_SIZE (LightningEnvironment.teardown), and a rank fits several Trainers


def rank() -> int:
    return _RANK


def world() -> int:
    return _WORLD


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


# -- the Fabric loop shared by sync_debug and table_builds ------------------------------------------------------
def gpt_cfg(args) -> dict:
    import gpu_checks

    return dict(gpu_checks.SMALL if cuda(args) and not args.small else gpu_checks.TINY)


def new_fabric(args, precision: str, backend: Optional[str] = None, **options):
    import lightning as L

    from lightning_mics.fabric import MiCSStrategy

    fabric = L.Fabric(accelerator=args.accelerator, devices=1, num_nodes=world(), precision=precision,
                      strategy=MiCSStrategy(process_group_backend=backend, **options))
    fabric.launch()
    return fabric


def loop_steps(fabric, model, opt, tokens, steps: range, accum: int, clip: bool) -> None:
    """``tokens``: (steps, ACCUM, batch, block + 1) on the device; this rank's rows of each micro-batch."""
    import gpu_checks

    per = tokens.shape[2] // fabric.world_size
    rows = slice(fabric.global_rank * per, (fabric.global_rank + 1) * per)
    for step in steps:
        for micro in range(accum):
            x = tokens[step, micro, rows]
            with fabric.no_backward_sync(model, enabled=micro < accum - 1):
                fabric.backward(gpu_checks.lm_loss(model(x[:, :-1]), x) / accum)
        if clip:
            fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()


def gpt_and_tokens(args, fabric, steps: int):
    import torch

    import gpu_checks

    model, tokens = gpu_checks.model_and_tokens(gpt_cfg(args), steps)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, opt, tokens.to(fabric.device)


# -- offload_dropout ------------------------------------------------------------------------------------------------
def check_offload_dropout(args) -> dict:
    try:
        from tests.helpers.offload_check import offload_dropout_check
    except ImportError as e:  # hook: tests/helpers/offload_check.py provides it
        return {"ok": False, "error": f"hook missing: tests.helpers.offload_check.offload_dropout_check ({e})"}
    deterministic(args)
    out = offload_dropout_check(args.accelerator)
    out["ran_on"] = str(out.pop("device", args.accelerator))
    return dict(out, ok=bool(out.get("ok")))


# -- sync_debug -------------------------------------------------------------------------------------------------
SYNC_VARIANTS = {  # name: (MiCS options, accumulation, clip)
    "s1": ({}, 1, False),
    "zero1": ({"shard_optimizer_state": True}, 1, False),
    "ac_offload": ({"activation_checkpointing": [BLOCK], "checkpoint_group_size": 2, "activation_offload": True},
                   1, False),
    "accum2_clip": ({}, 2, True),
}


def _sync_site(stack) -> str:
    """``file:line`` of the innermost frame outside torch and warnings, and of the innermost in lightning_mics/
    (``engine ...``) when that is another one."""
    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(warnings_file()))
    frames = [f for f in stack if not os.path.abspath(f.filename).startswith(skip)]

    def where(f) -> str:
        path = os.path.abspath(f.filename)
        return f"{os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else path}:{f.lineno}"

    if not frames:
        return "?"
    site = where(frames[-1])
    engine = next((f for f in reversed(frames) if os.sep + "lightning_mics" + os.sep in os.path.abspath(f.filename)),
                  None)
    return site if engine is None or engine is frames[-1] else f"{site} (engine {where(engine)})"


def warnings_file() -> str:
    import warnings

    return warnings.__file__


def check_sync_debug(args) -> dict:
    import warnings

    import torch

    try:
        from tests.helpers.host_reads import HostReads
    except ImportError:  # hook: tests/helpers/host_reads.py (the host-read counting mode); optional here
        HostReads = None
    warm, warn_steps, error_steps = (1, 2, 1) if args.small else (3, 3, 2)
    variants = {k: v for k, v in SYNC_VARIANTS.items() if not args.small or k in ("s1", "ac_offload")}
    out: Dict[str, Any] = {"warmup_steps": warm, "warn_steps": warn_steps, "error_steps": error_steps,
                           "host_reads_available": HostReads is not None, "variants": {}}
    for name, (options, accum, clip) in variants.items():
        row: Dict[str, Any] = {}
        try:
            fabric = new_fabric(args, "bf16-mixed", **options)
            model, opt, tokens = gpt_and_tokens(args, fabric, warm + warn_steps + error_steps)
            loop_steps(fabric, model, opt, tokens, range(warm), accum, clip)
            if cuda(args):
                torch.cuda.synchronize()
            reads = HostReads() if HostReads is not None else None
            syncs: Dict[str, int] = {}  # site -> synchronizing calls (the warnings of sync debug mode "warn")

            def seen(message, category, filename, lineno, file=None, line=None) -> None:
                if "synchroniz" in str(message).lower():
                    site = _sync_site(traceback.extract_stack()[:-1])
                    syncs[site] = syncs.get(site, 0) + 1

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = seen  # (catch_warnings puts the original back)
                if cuda(args):
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with reads if reads is not None else contextlib.nullcontext():
                        loop_steps(fabric, model, opt, tokens, range(warm, warm + warn_steps), accum, clip)
                finally:
                    if cuda(args):
                        torch.cuda.set_sync_debug_mode("default")
            if cuda(args):
                row["syncs"] = sum(syncs.values())
                row["sync_sites"] = dict(sorted(syncs.items(), key=lambda kv: -kv[1])[:12])
                torch.cuda.set_sync_debug_mode("error")
                try:
                    end = warm + warn_steps + error_steps
                    loop_steps(fabric, model, opt, tokens, range(warm + warn_steps, end), accum, clip)
                    row["error_mode"] = "no error"
                except RuntimeError as e:
                    row["error_mode"] = tail(str(e), 3, 400)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            if reads is not None:
                row["host_reads_engine"], row["host_reads_outside"] = reads.engine, reads.outside
                by_who: Dict[str, int] = {}
                for who, _, _, n in reads.listing():
                    by_who[who] = by_who.get(who, 0) + n
                row["host_reads_by_who"] = by_who
                row["host_read_sites"] = [list(s) for s in reads.listing()[:12]]
        except Exception:  # noqa: BLE001  (recorded; the next variant runs in a new Fabric)
            row["error"] = tail(traceback.format_exc())
        out["variants"][name] = row
    rows = out["variants"].values()
    if not cuda(args):
        return dict(out, ok=None, reason="torch.cuda.set_sync_debug_mode needs CUDA; on CPU the same loops ran and "
                                         "the host's reads of tensor data are counted instead",
                    errors=[r["error"] for r in rows if "error" in r])
    out["syncs"] = sum(r.get("syncs", 0) for r in rows)
    out["ok"] = all("error" not in r and r.get("syncs") == 0 and r.get("error_mode") == "no error" for r in rows)
    return out


# -- table_builds -------------------------------------------------------------------------------------------------
def kernel_table_builds(args) -> dict:
    """The four bucket copies and int8 quantize / dequantize on a small bucket set: new inputs each call (as
    autograd's gradients are), outputs views of one buffer (as a unit's parameters are). 1 call of each to warm up,
    then 3; the builds counted over those."""
    import torch

    import lightning_mics_kernels as tk

    if not hasattr(tk, "table_stats"):  # hook: lightning_mics_kernels.table_stats() (the descriptor-table counters)
        raise RuntimeError("hook missing: lightning_mics_kernels.table_stats()")
    dev = args.accelerator
    sizes = [640, 64, 1536, 128, 4096 + 64, 64 * 7]
    chunks, block = 2, 512
    total = sum(-(-s // chunks) for s in sizes)
    flat = torch.empty(sum(sizes), device=dev)
    buf = torch.empty(chunks, total, device=dev)
    params = list(torch.empty(sum(sizes), device=dev).split(sizes))
    residual = torch.zeros(sum(sizes), device=dev)

    def one_round() -> None:
        grads = [torch.randn(s, device=dev) for s in sizes]  # new allocations every call
        tk.flatten(grads, out=flat, backend="triton")
        tk.flatten(grads, dtype=torch.bfloat16, backend="triton")
        tk.scatter(flat, params, backend="triton")
        tk.chunk_cat(grads, chunks, out=buf, backend="triton")
        tk.chunk_split(buf, params, chunks, backend="triton")
        qz = tk.quantize(grads, block, num_chunks=chunks, residual=residual, backend="triton")
        tk.dequantize(qz.wire, params, block, num_chunks=chunks, backend="triton")
        tk.dequantize_sum(qz.wire, chunks, block, backend="triton")

    one_round()
    before = tk.table_stats()
    for _ in range(3):
        one_round()
    after = tk.table_stats()
    return {"builds_in_warmup": before.builds, "builds_after_warmup": after.builds - before.builds,
            "lookups_after_warmup": after.lookups - before.lookups,
            "pointer_copies_after_warmup": after.pointer_copies - before.pointer_copies}


TABLE_VARIANTS = {  # name: (precision, MiCS options); int8 needs s > 1 and replicas: 4 ranks (not with --small)
    "fp32_s2": ("32-true", {"sharded_data_parallel_degree": 2}),
    "bf16_s2_int8_feedback": ("bf16-mixed", {"sharded_data_parallel_degree": 2,
                                             "quantize_gradients": "error_feedback"}),
}


def table_variants(args) -> Dict[str, Any]:
    return {k: v for k, v in TABLE_VARIANTS.items() if not args.small or "int8" not in k}


def table_world(args) -> int:
    return 2 if args.small else 4


def worker_table_builds(args) -> None:
    """One rank of table_builds' engine part: kernels="triton"; on CUDA its collectives over gloo on host copies."""
    import lightning_mics_kernels as tk

    warm, steady = 2, 2 if args.small else 3
    out: Dict[str, Any] = {"rank": rank()}
    path = Path(args.scratch) / f"table_builds.{rank()}.json"
    with Modes(host=cuda(args), every=False, late=0.0) as modes:
        for name, (precision, options) in table_variants(args).items():
            fabric = new_fabric(args, precision, backend="gloo", hierarchical_allgather=False,
                                param_persistence_threshold=0, kernels="triton",
                                ranks_per_node=world(), timeout=120, **options)
            model, opt, tokens = gpt_and_tokens(args, fabric, warm + steady)
            start = tk.table_stats()
            loop_steps(fabric, model, opt, tokens, range(warm), 2, True)
            before = tk.table_stats()
            loop_steps(fabric, model, opt, tokens, range(warm, warm + steady), 2, True)
            after = tk.table_stats()
            out[name] = {"builds_in_warmup": before.builds - start.builds,
                         "builds_after_warmup": after.builds - before.builds,
                         "lookups_after_warmup": after.lookups - before.lookups,
                         "pointer_copies_after_warmup": after.pointer_copies - before.pointer_copies}
            write_json(path, out)
        out["host_copied"] = dict(modes.host.routed) if modes.host is not None else None
    write_json(path, out)


def check_table_builds(args) -> dict:
    variants, n = table_variants(args), table_world(args)
    ranks = Ranks(args, "table_builds", n, [])  # the engine's, beside the kernels' own below
    out: Dict[str, Any] = {}
    try:
        out["kernels"] = kernel_table_builds(args)
    except Exception:  # noqa: BLE001
        out["kernels"] = {"error": tail(traceback.format_exc())}
    error = ranks.finish(args.deadline)
    engine = [json.loads(p.read_text()) if p.exists() else {}
              for p in (Path(args.scratch) / f"table_builds.{r}.json" for r in range(n))]
    out["engine"] = {name: [e.get(name) for e in engine] for name in variants}
    if cuda(args):
        out["engine"]["host_copied"] = engine[0].get("host_copied")
    if error:
        out["engine"]["error"] = error
    k = out["kernels"]
    kernels_ok = k.get("builds_after_warmup") == 0 and k.get("lookups_after_warmup", 0) > 0
    engine_ok = not error and all(r is not None and r["builds_after_warmup"] == 0 and r["lookups_after_warmup"] > 0
                                  for rows in (out["engine"][v] for v in variants) for r in rows)
    out["builds_after_warmup"] = (k.get("builds_after_warmup") or 0) + sum(
        r["builds_after_warmup"] for v in variants for r in out["engine"][v] if r is not None)
    return dict(out, ok=bool(kernels_ok and engine_ok), kernels_ok=kernels_ok, engine_ok=engine_ok)


# -- triton_small_bucket ----------------------------------------------------------------------------------------
def check_triton_small_bucket(args) -> dict:
    import torch

    import kernels

    dev = args.accelerator
    nbytes = 2**20 if cuda(args) else 2**16
    tensors = (10, 100) if cuda(args) and not args.small else (10,)
    casts = kernels.CASTS if cuda(args) else {"fp32": torch.float32}
    bench, gen = kernels.timer(dev), torch.Generator().manual_seed(0)
    figures, rows = {}, []
    for op in kernels.OPS:
        for cast, dst in casts.items():
            for n in tensors:
                sizes = kernels.sizes_for(n, nbytes // 4, gen, False)
                key = dict(op=op, cast=cast, n=n, bytes=nbytes)
                make = lambda: kernels.cases(op, dst, sizes, 8, dev, 2048, True)  # noqa: E731  (views: as the engine)
                case = kernels.rotated(make, 3) if hasattr(kernels, "rotated") else make()
                got = kernels.measure(key, case, bench, True, dev)  # asserts every output bit-equal first
                rows += got
                kernels.report_group(rows, op, cast, n, nbytes)
                tri = next(r for r in got if r["impl"] == "triton")
                best = min((r for r in got if r["impl"] not in ("triton", "copy")), key=lambda r: r["s"])
                figures[f"{op} {cast} n={n}"] = {"vs_torch": round(tri["vs torch"], 3), "triton_us": round(
                    tri["s"] * 1e6, 2), "best_torch": best["impl"], "torch_us": round(best["s"] * 1e6, 2),
                    "tables_built_while_timed": tri.get("builds")}
                if cuda(args):
                    torch.cuda.empty_cache()
    ratios = [f["vs_torch"] for f in figures.values()]
    out = {"bucket_bytes": nbytes, "outputs_bit_equal": True, "vs_torch_min": min(ratios),
           "vs_torch_median": statistics.median(ratios), "cases": figures,
           "tables_built_while_timed": sum(f["tables_built_while_timed"] or 0 for f in figures.values())}
    if not cuda(args):
        return dict(out, ok=None, reason="the Triton interpreter's times say nothing of a GPU's: outputs checked "
                                         "bit for bit at a 64 KB bucket")
    return dict(out, target=TARGET["triton_small_bucket"], ok=out["vs_torch_min"] >= TARGET["triton_small_bucket"])


# -- single_gpu_overhead --------------------------------------------------------------------------------------------
TRAINER_CASES = ("bare", "mics")  # benchmarks/single_gpu.py's
FABRIC_CASES = ("fabric_mics", "fabric_fsdp")


def fabric_case(case: str, config: str, steps: int, warmup: int, accelerator: str) -> dict:
    """single_gpu.py's bare loop under Fabric: ``model.loss`` marked as a forward method, so it runs inside the
    strategy's and the precision's forward, as the Trainer's training_step does."""
    import lightning as L
    import torch

    import single_gpu

    torch.backends.cuda.matmul.allow_tf32 = True
    model, tokens = single_gpu.model_and_batches(config, steps)
    gpu = accelerator == "gpu"
    if case == "fabric_mics":
        from lightning_mics.fabric import MiCSStrategy

        strategy = MiCSStrategy()
    else:
        from lightning.fabric.strategies import FSDPStrategy

        from lightning_mics.app.models.gpt import Block

        strategy = FSDPStrategy(auto_wrap_policy={Block})
    fabric = L.Fabric(accelerator="cuda" if gpu else "cpu", devices=1, precision="bf16-mixed", strategy=strategy)
    fabric.launch()
    module = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=3e-4))
    module.mark_forward_method("loss")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for i in range(steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        batch = tokens[i].to(fabric.device, non_blocking=True)
        fabric.backward(module.loss(batch[:, :-1], batch[:, 1:]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    elapsed = time.perf_counter() - t0
    timed = steps - warmup
    return {"case": case, "config": config, "step_s": elapsed / timed,
            "tokens_per_s": timed * tokens.shape[1] * (tokens.shape[2] - 1) / elapsed,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if gpu else None}


def spawn_fabric_case(case: str, config: str, sg_args) -> dict:
    cmd = [sys.executable, __file__, "--worker", "fabric_case", "--case", case, "--config", config, "--steps",
           str(sg_args.steps), "--warmup", str(sg_args.warmup), "--accelerator",
           "cuda" if sg_args.accelerator == "gpu" else "cpu", "--scratch", sg_args.scratch]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=sg_args.env, timeout=sg_args.case_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"case": case, "config": config, "error": tail(proc.stderr or proc.stdout)}
    return json.loads(lines[-1][len("RESULT "):])


def check_single_gpu_overhead(args) -> dict:
    import single_gpu

    config = "gpt2-124m" if cuda(args) and not args.small else "tiny"
    steps, warmup = (30, 10) if cuda(args) and not args.small else (4, 1)
    rounds = args.rounds if cuda(args) else 1
    cases = list(TRAINER_CASES) + [c for c in FABRIC_CASES if cuda(args) or c != "fabric_fsdp"]  # FSDP: CUDA only
    sg_args = argparse.Namespace(steps=steps, warmup=warmup, accelerator="gpu" if cuda(args) else "cpu",
                                 case_timeout=150, scratch=args.scratch, env=child_env(args))
    runs: Dict[str, List[dict]] = {c: [] for c in cases}
    for r in range(rounds):  # interleaved: a drift of the machine falls on every case alike
        began = time.time()
        for case in cases:
            try:
                res = (spawn_fabric_case(case, config, sg_args) if case in FABRIC_CASES
                       else single_gpu.spawn(case, config, sg_args))
            except subprocess.TimeoutExpired:
                res = {"case": case, "config": config, "error": f"out of time ({sg_args.case_timeout} s)"}
            runs[case].append(res)
            if res.get("params_file"):  # single_gpu.py's trained parameters (0.5 GB for GPT-2): not compared here
                Path(res.pop("params_file")).unlink(missing_ok=True)
            print(json.dumps({"overhead_case": case, **{k: v for k, v in res.items() if k != "error"},
                              **({"error": res["error"][-300:]} if "error" in res else {})}), flush=True)
        if r + 1 < rounds and time.time() + 1.2 * (time.time() - began) > args.deadline:
            print(f"single_gpu_overhead: {r + 1} of {rounds} rounds (the next would end after the deadline)")
            break
    out: Dict[str, Any] = {"config": config, "steps": steps, "warmup": warmup, "rounds": len(runs["bare"]),
                           "tokens_per_s": {}, "vs_bare": {}, "vs_bare_rounds": {}}
    errors = {c: r["error"] for c, rs in runs.items() for r in rs if "error" in r}
    for case in cases:
        ok_rounds = [r for r in runs[case] if "error" not in r]
        if ok_rounds:
            out["tokens_per_s"][case] = round(statistics.median(r["tokens_per_s"] for r in ok_rounds), 1)
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[case], runs["bare"])
                  if "error" not in r and "error" not in b]
        if ratios and case != "bare":
            out["vs_bare_rounds"][case] = [round(x, 4) for x in ratios]
            out["vs_bare"][case] = round(statistics.median(ratios), 4)  # the median of each round's own ratio
    if "fabric_fsdp" in out["vs_bare"] and "fabric_mics" in out["vs_bare"]:
        out["fabric_mics_vs_fsdp"] = round(out["vs_bare"]["fabric_mics"] / out["vs_bare"]["fabric_fsdp"], 4)
    out["trainer"], out["fabric"] = out["vs_bare"].get("mics"), out["vs_bare"].get("fabric_mics")
    if errors:
        out["error"] = "; ".join(f"{c}: {e[-600:]}" for c, e in errors.items())
    if not cuda(args):
        return dict(out, ok=None, reason="a CPU ratio on a tiny GPT says nothing of the GPU target")
    target = TARGET["single_gpu_overhead"]
    return dict(out, target=target, ok=not errors and all(
        out[k] is not None and out[k] >= target for k in ("trainer", "fabric")))


# -- sanitizer ------------------------------------------------------------------------------------------------------
def sanitizer_cases(args, part: str) -> List[Any]:
    from tests.comm.test_late_collectives import FABRIC_CASES as LATE_FABRIC, FP32

    reduced = args.dry_run and args.small
    if part == "trainer":
        return [dict(v) for v in FP32] if not reduced else [{"s": 2, "prefetch": 2}]
    if part == "fabric":
        return list(LATE_FABRIC) if not reduced else ['late:2:2:adamw:norm:32-true:{"prefetch":2}']
    ac_fabric = {"activation_checkpointing": ["tests.helpers.models.MLPBlock"], "checkpoint_group_size": 2,
                 "activation_offload": True}
    ac_trainer = {"activation_checkpointing": [BLOCK], "checkpoint_group_size": 2, "activation_offload": True}
    cases = [("fabric", "32-true", "s1", {}), ("fabric", "32-true", "zero1", {"shard_optimizer_state": True}),
             ("fabric", "32-true", "ac_offload", ac_fabric), ("fabric", "bf16-mixed", "s1", {}),
             ("fabric", "bf16-mixed", "zero1", {"shard_optimizer_state": True}),
             ("fabric", "bf16-mixed", "ac_offload", ac_fabric),
             ("trainer", "32-true", "s1", {}), ("trainer", "32-true", "zero1", {"shard_optimizer_state": True}),
             ("trainer", "32-true", "ac_offload", ac_trainer)]
    return cases if not reduced else [c for c in cases if c[0] == "fabric" and c[1] == "32-true"]


def _trainer_state(args, variant: dict, precision: str, backend: Optional[str]):
    """tests/engine/equiv.py's model, batches and optimizer (3 GPT blocks, AdamW, accumulation 2, clipping 1.0,
    3 steps) under a Trainer on this accelerator, one "node" per rank: the full state dict (rank 0)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import tests.engine.equiv as E
    from lightning_mics import MiCSStrategy

    E.LAYERS = 3
    steps, accum, batch = 3, 2, 2
    x, y = E.data(world(), batch, steps, accum)
    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, world(), rank(), shuffle=False))
    variant = dict(variant)
    s = variant.pop("s", 1)
    strategy = MiCSStrategy(sharded_data_parallel_degree=s, param_persistence_threshold=0, state_dict_type="full",
                            ranks_per_node=variant.pop("ranks_per_node", world()), kernels="torch", timeout=120,
                            process_group_backend=backend, **variant)
    trainer = L.Trainer(accelerator="gpu" if cuda(args) else "cpu", devices=1, num_nodes=world(), strategy=strategy,
                        max_steps=steps, accumulate_grad_batches=accum, gradient_clip_val=1.0, precision=precision,
                        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, logger=False, enable_checkpointing=False,
                        use_distributed_sampler=False)
    torch.manual_seed(0)
    module = E.Module("gpt", "adamw")
    trainer.fit(module, loader)
    return trainer.strategy.lightning_module_state_dict(), trainer.global_step


def _fabric_state(args, s: int, accum: int, kind: str, clip: str, precision: str, options: dict,
                  backend: Optional[str]):
    """tests/fabric/fabric_loop.py's loop (``case_late``'s: 3 blocks, ``setup(..., "split")``, 4 steps, a probe
    forward after) with its batches on this accelerator: the full state dict (rank 0)."""
    import torch

    import tests.fabric.fabric_loop as FL

    options = dict(options)
    fabric = new_fabric(args, precision, backend=backend, sharded_data_parallel_degree=s,
                        param_persistence_threshold=16, kernels="torch", timeout=120,
                        ranks_per_node=options.pop("ranks_per_node", world()), **options)
    model, opt, _ = FL.setup(fabric, "split", kind, layers=3)
    FL.fabric_steps(fabric, model, opt, FL.batches(accum).to(fabric.device), clip, 0, FL.STEPS)
    with torch.no_grad():
        model(FL.batches(1)[0, 0, :2, :-1].to(fabric.device))
    return FL.full_state(fabric, model), FL.STEPS


def _equal(a: dict, b: dict) -> dict:
    import torch

    if not a:  # not rank 0
        return {}
    return {"bit_equal": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
            "max_abs": max((float((a[k].double().cpu() - b[k].double().cpu()).abs().max()) if a[k].numel() else 0.0)
                           for k in a)}


def _csan_on() -> bool:
    try:
        import torch.cuda._sanitizer as csan
    except ImportError:
        return False
    return bool(getattr(csan, "cuda_sanitizer", None) is not None and csan.cuda_sanitizer.enabled)


def _planted_read(args, case: dict, prompt: dict, backend: Optional[str]) -> dict:
    """The device can fail a run: the first Trainer case again, on host copies, with a unit's all-gather output read
    before its ``wait()`` (``read_before_wait`` in tests/helpers/late_collectives.py); its full state must differ
    from the case's own (``caught``). Rank 0 judges."""
    from tests.helpers.late_collectives import read_before_wait

    with read_before_wait(), Modes(host=True, every=args.dry_run, late=0.0):
        state, _ = _trainer_state(args, case, "32-true", backend)
    got = _equal(state, prompt)
    return {"case": json.dumps(case), "planted": "read before wait()", **({"caught": not got["bit_equal"]}
                                                                       if got else {})}


def worker_sanitizer(args) -> None:
    """One rank of a sanitizer launch (``--part``): every case in turn, written after each; an error (a CSAN report
    is one) ends the rank, and with it the launch: the ranks' collectives would no longer match."""
    import warnings

    import torch

    deterministic(args)
    part, multi = args.part, args.part != "one"
    backend = "gloo" if multi else None  # one process: NCCL on CUDA (gloo on CPU)
    path = Path(args.scratch) / f"sanitizer_{part}.{rank()}.json"
    out: Dict[str, Any] = {"rank": rank(), "world": world(), "csan": _csan_on(), "cases": [], "host_copied": {},
                           "unrouted": {}, "nondeterministic_warnings": 0}
    refs: Dict[str, dict] = {}
    for case in sanitizer_cases(args, part):
        label = json.dumps(case) if part == "trainer" else case if part == "fabric" else ":".join(
            [case[0], case[1], case[2]])
        row: Dict[str, Any] = {"case": label}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                finals = []
                for late in ((0.0, LATE) if multi else (0.0,)):
                    with Modes(host=multi, every=args.dry_run, late=late) as modes:
                        if part == "trainer":
                            state, steps = _trainer_state(args, case, "32-true", backend)
                        elif part == "fabric":
                            _, s, accum, kind, clip, precision, *opts = case.split(":")
                            state, steps = _fabric_state(args, int(s), int(accum), kind, clip, precision,
                                                         json.loads(":".join(opts) or "{}"), backend)
                        elif case[0] == "fabric":
                            state, steps = _fabric_state(args, 1, 2, "adamw", "norm", case[1], case[3], backend)
                        else:
                            state, steps = _trainer_state(args, dict(case[3], s=1), case[1], backend)
                    finals.append(state)
                    if late:
                        row["late_issued"] = sum(modes.late.issued.values())
                    if modes.host is not None:
                        _add(out["host_copied"], modes.host.routed)
                        _add(out["unrouted"], modes.host.unrouted)
            out["nondeterministic_warnings"] += sum("deterministic" in str(w.message) for w in caught)
            row["steps"] = steps
            if multi:
                row.update(_equal(finals[0], finals[1]))
            elif finals[0]:  # one process: against the same front end and precision's s = 1 layout
                ref = refs.setdefault(f"{case[0]}:{case[1]}", finals[0])
                row["max_abs_vs_s1"] = _equal(finals[0], ref)["max_abs"]
                row["finite"] = all(bool(torch.isfinite(v.float()).all()) for v in finals[0].values()
                                    if v.is_floating_point())
        except BaseException:  # noqa: BLE001  (a CSAN report raises CUDASanitizerErrors)
            text = traceback.format_exc()
            row["error"] = tail(text, 20, 4000)
            row["sanitizer_report"] = "CUDASanitizerErrors" in text or "CSAN detected" in text
            out["cases"].append(row)
            write_json(path, out)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
        out["cases"].append(row)
        write_json(path, out)
        if part == "trainer" and "self_test" not in out:  # after the first case, on every rank
            out["self_test"] = _planted_read(args, case, finals[0], backend)
            write_json(path, out)
    write_json(path, dict(out, done=True))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads at exit: [Note: groups at exit] in lightning_mics/layout/topology.py


def check_sanitizer(args) -> dict:
    if not cuda(args) and not args.dry_run:
        return {"ok": None, "reason": "CSAN (TORCH_CUDA_SANITIZER) needs CUDA; --sanitizer-dry-run runs the machinery "
                                      "on CPU"}
    reduced = args.dry_run and args.small
    worlds = {"trainer": 2 if reduced else 4, "fabric": 2 if reduced else 4, "one": 1}
    launches = {p: Ranks(args, "sanitizer", worlds[p], ["--part", p] + (["--sanitizer-dry-run"] if args.dry_run
                                                                         else []), sanitizer=True,
                              tag=f"sanitizer_{p}")
                for p in SANITIZER_PARTS}  # at once: one GPU, 9 processes
    out: Dict[str, Any] = {"dry_run": args.dry_run, "parts": {}, "covers": [], "failed": [], "not_run": []}
    ok, reports = True, 0
    for part, launch in launches.items():
        error = launch.finish(args.deadline)
        ranks = [json.loads(p.read_text()) if p.exists() else {}
                 for p in (Path(args.scratch) / f"sanitizer_{part}.{r}.json" for r in range(worlds[part]))]
        r0 = ranks[0]
        planned = [c if isinstance(c, str) else json.dumps(c) if part == "trainer" else ":".join(c[:3])
                   for c in sanitizer_cases(args, part)]
        rows = r0.get("cases", [])
        for i, label in enumerate(planned):
            tag = f"{part}:{label}"
            row = rows[i] if i < len(rows) else None
            others_clean = all(i < len(r.get("cases", [])) and "error" not in r["cases"][i] for r in ranks[1:])
            if row is None:
                out["not_run"].append(tag)
                continue
            good = "error" not in row and others_clean and (
                row.get("bit_equal") is True if part != "one" else row.get("finite", False))
            (out["covers"] if good else out["failed"]).append(tag)
        reports += sum(bool(c.get("sanitizer_report")) for r in ranks for c in r.get("cases", []))
        out["parts"][part] = {"world": worlds[part], "csan": [r.get("csan") for r in ranks],
                              "cases": rows, "other_ranks_errors": [c["error"] for r in ranks[1:]
                                                                    for c in r.get("cases", []) if "error" in c],
                              "host_copied": r0.get("host_copied"), "unrouted": r0.get("unrouted"),
                              "nondeterministic_warnings": r0.get("nondeterministic_warnings")}
        if error:
            out["parts"][part]["error"] = error
        csan_ok = args.dry_run or all(r.get("csan") for r in ranks)
        if not csan_ok:
            out["parts"][part]["error"] = (out["parts"][part].get("error", "") + " CSAN was not enabled").strip()
        if part == "trainer":
            out["self_test"] = r0.get("self_test")
            ok = ok and bool((r0.get("self_test") or {}).get("caught"))
        ok = ok and not error and csan_ok and bool(r0.get("done"))
    out["sanitizer_reports"] = reports  # cases ended by a CSAN report, on any rank
    out["not_covered"] = NOT_COVERED
    return dict(out, ok=ok and not out["failed"] and not out["not_run"])


# -- the driver -------------------------------------------------------------------------------------------------
CHECK_FNS = {"offload_dropout": check_offload_dropout, "sanitizer": check_sanitizer, "sync_debug": check_sync_debug,
             "table_builds": check_table_builds, "single_gpu_overhead": check_single_gpu_overhead,
             "triton_small_bucket": check_triton_small_bucket}


class Check:
    """One check in its own process group (its ranks and cases inside it), started now; ``result()`` waits for it
    (at most ``timeout`` from its start): its result, or its log's last lines."""

    def __init__(self, args, name: str, timeout: float) -> None:
        self.name, self.timeout, self.start = name, timeout, time.time()
        scratch = Path(args.scratch) / name
        scratch.mkdir(parents=True, exist_ok=True)
        self.result_path, self.log = scratch / "result.json", scratch / "check.log"
        cmd = [sys.executable, __file__, "--check", name, "--accelerator", args.accelerator, "--scratch",
               str(scratch), "--rounds", str(args.rounds), "--deadline", str(self.start + timeout - 10),
               *(["--small"] if args.small else []), *(["--sanitizer-dry-run"] if args.dry_run else [])]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=child_env(args), stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def result(self) -> dict:
        try:
            self.proc.wait(timeout=max(0.01, self.start + self.timeout - time.time()))
        except subprocess.TimeoutExpired:
            pass
        try:  # the check and whatever it left running (its ranks, its cases): one process group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.result_path.exists():
            return json.loads(self.result_path.read_text())
        why = "out of time" if self.proc.returncode == -signal.SIGKILL else f"rc {self.proc.returncode}"
        return {"ok": False, "error": f"{why} after {time.time() - self.start:.0f} s (timeout {self.timeout:.0f} s): "
                                      f"{tail(self.log.read_text() if self.log.exists() else '')}"}


def check_main(args) -> None:
    args.deadline = float(args.deadline)
    start = time.time()
    try:
        out = CHECK_FNS[args.check](args)
    except Exception:  # noqa: BLE001
        out = {"ok": False, "error": tail(traceback.format_exc())}
    out["wall_s"] = round(time.time() - start, 1)  # its own process's time (the driver may collect it later)
    write_json(Path(args.scratch) / "result.json", out)
    sys.stdout.flush()
    os._exit(0)  # a Fabric's gloo group at exit ([Note: groups at exit] in lightning_mics/layout/topology.py)


def worker_main(args) -> None:
    if args.worker == "fabric_case":
        print("RESULT " + json.dumps(fabric_case(args.case, args.config, args.steps, args.warmup,
                                                 "gpu" if cuda(args) else "cpu")), flush=True)
        os._exit(0)
    {"sanitizer": worker_sanitizer, "table_builds": worker_table_builds}[args.worker](args)
    sys.stdout.flush()
    os._exit(0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="reduced sizes and steps (what runs on CPU in the test)")
    p.add_argument("--checks", nargs="+", default=list(ORDER), choices=ORDER, help="these checks only (in this order)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks", help="where gpu_ready_<device>.jsonl goes")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every check's own timeout")
    p.add_argument("--timeout", nargs="+", default=[], metavar="CHECK=SECONDS",
                   help=f"a check's own timeout (defaults: {TIMEOUT})")
    p.add_argument("--rounds", type=int, default=3, help="single_gpu_overhead: interleaved rounds")
    p.add_argument("--commit", help="the commit to record (default: git rev-parse --short HEAD, +dirty)")
    p.add_argument("--sanitizer-dry-run", dest="dry_run", action="store_true",
                   help="sanitizer on CPU: its launches without CSAN, host copies forced (--small: 2 ranks, 5 cases)")
    p.add_argument("--keep", type=Path, help="keep every check's logs and files here (default: a temporary folder)")
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--check", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--deadline", default=str(time.time() + 600), help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check:
        return check_main(args)
    if args.worker:
        args.deadline = float(args.deadline)
        return worker_main(args)
    import tempfile

    if cuda(args):
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device: use --accelerator cpu --small")
        device = torch.cuda.get_device_name(0)
    else:
        device = "cpu"
    commit = args.commit or commit_id()
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"gpu_ready_{device_slug(device)}.jsonl"
    timeouts = dict(TIMEOUT)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in timeouts:
            p.error(f"--timeout {item}: no check {name!r}")
        timeouts[name] = float(seconds)
    end = time.time() + args.budget
    chosen = [c for c in ORDER if c in args.checks]

    def write(name: str, result: dict, start: float) -> None:
        line = {"commit": commit, "check": name, "ok": result.pop("ok", False), "device": device, "at": at,
                "wall_s": result.pop("wall_s", round(time.time() - start, 1)), **result}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)

    def start(name: str, reserve: float = 0.0) -> Optional[Check]:
        left = end - time.time() - reserve
        if left < 30:
            write(name, {"ok": False, "error": f"not run: the budget (--budget {args.budget:.0f} s) was spent"},
                  time.time())
            return None
        return Check(args, name, min(timeouts[name] * args.timeout_scale, left))

    if args.keep:
        args.keep = args.keep.resolve()
        args.keep.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="gpu_ready_")
          ) as scratch:
        args.scratch = scratch
        # The sanitizer (the longest) runs beside the checks that time nothing; the timed ones run alone after it.
        timed = [c for c in chosen if c in TIMED]
        beside = start("sanitizer", reserve=sum(TIMED[c] for c in timed)) if "sanitizer" in chosen else None
        for name in [c for c in chosen if c != "sanitizer" and c not in TIMED]:
            check = start(name)
            if check is not None:
                write(name, check.result(), check.start)
        if beside is not None:
            write("sanitizer", beside.result(), beside.start)
        for name in timed:
            check = start(name)
            if check is not None:
                write(name, check.result(), check.start)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
