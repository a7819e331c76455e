"""What only a GPU can show, in one call: the CUDA paths the CPU suite never takes, checked against a plain loop.

    python benchmarks/gpu_checks.py                                  # one CUDA device, a few minutes
    python benchmarks/gpu_checks.py --accelerator cpu --small 2      # the same cases on CPU (a dry run)

Every case runs in its own process(es): a fresh CUDA context, allocator and dynamo cache. The correctness cases
run deterministically (``torch.use_deterministic_algorithms``, TF32 off, the math attention kernel) on a small
GPT in fp32, so "the same arithmetic" reads as a difference of 0 rather than as a spread:

- ``plain``: one plain process, AdamW, accumulation 2, clipping by norm: the reference of every case below;
- ``fp16`` / ``fp16_plain``: ``L.Fabric(precision="16-mixed")`` under MiCS (sharded loss scaling) against a plain
  loop with ``torch.autocast(float16)`` and ``torch.amp.GradScaler``; step 2's loss is multiplied by 1e30, so
  its fp16 gradients overflow and both must skip that step and halve the scale;
- ``zero1``: the optimizer-state-only layout (``shard_optimizer_state``, s = 1) on one process: the
  root unit pinned (kept gathered), full gradients accumulated, the optimizer stepping its rows and the
  refresh after the step making the parameters whole ([Note: optimizer-state-only sharding] in gradients.py);
- ``ac``, ``ac_offload``: MiCS's activation checkpointing per block, and in groups of 2 with the saved inputs
  offloaded to pinned host memory on a side stream (activations.py);
- ``compile_ac``: the model compiled whole before ``fabric.setup`` (litgpt's pattern) with the grouped,
  offloaded checkpointing; dynamo's graph count after the first step and at the end;
- ``two_triton``, ``two_torch``: two processes on the one GPU (NCCL takes one rank per GPU, so gloo carries
  the collectives; ``num_nodes=2`` gives each process the device), s = 2, so parameters and gradients go
  through bucket copies: the Triton kernels (their descriptor-table lookups counted) and torch's copies. A probe
  first checks that gloo runs the three collectives on CUDA tensors. On torch 2.11 the probe passes but gloo's
  allgather then segfaults on the engine's CUDA buckets (benchmarks/LOG.md): these two run on CPU only.

Then speed and memory, not deterministic: GPT-2 124M under ``bf16-mixed``, MiCS without checkpointing, with
it, and with grouped offloaded checkpointing (step ms, peak allocated GB). At 8 sequences per step that step is
bound by the host, and the same case moved by up to 50% from one process to the next on an H200
(benchmarks/LOG.md): ``--rounds R`` runs the speed cases R times, interleaved, and reports each case's median
with every round; ``--batch`` sets the sequences per step (a larger one makes the step the GPU's). Prints one JSON
line per case (and round) and writes them all to ``<out>/gpu_checks.json``.

    python benchmarks/gpu_checks.py --cases speed_ac2 speed_ac_offload --rounds 5 --batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers
BLOCK = "lightning_mics.app.models.gpt.Block"
SMALL = dict(n_layer=4, n_head=4, n_embd=256, vocab=4096, block=256, batch=8)  # batch: global micro-batch
TINY = dict(n_layer=4, n_head=2, n_embd=32, vocab=128, block=16, batch=4)  # --accelerator cpu
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, vocab=50257, block=1024, batch=8)
ACCUM, STEPS, BLOW_UP = 2, 6, 2
CASES = {  # name: (processes, MiCS options, precision, compile)
    "plain": (1, None, "32-true", False),
    "fp16_plain": (1, None, "16-mixed", False),
    "compile_plain": (1, None, "32-true", True),
    "fp16": (1, {}, "16-mixed", False),
    "mics": (1, {}, "32-true", False),
    "zero1": (1, {"shard_optimizer_state": True}, "32-true", False),
    "ac": (1, {"activation_checkpointing": [BLOCK]}, "32-true", False),
    "ac_offload": (1, {"activation_checkpointing": [BLOCK], "checkpoint_group_size": 2,
                       "activation_offload": True}, "32-true", False),
    "compile_ac": (1, {"activation_checkpointing": [BLOCK], "checkpoint_group_size": 2,
                       "activation_offload": True}, "32-true", True),
    "two_triton": (2, {"sharded_data_parallel_degree": 2, "hierarchical_allgather": False,
                       "param_persistence_threshold": 0, "kernels": "triton"}, "32-true", False),
    "two_torch": (2, {"sharded_data_parallel_degree": 2, "hierarchical_allgather": False,
                      "param_persistence_threshold": 0, "kernels": "torch"}, "32-true", False),
}
SIBLING = {"zero1": "mics", "ac": "mics", "ac_offload": "ac", "compile_ac": "compile_plain", "two_triton": "mics",
           "two_torch": "two_triton"}  # the case each is also compared with
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce")
SPEED = {"speed_none": {}, "speed_ac": {"activation_checkpointing": [BLOCK]},
         "speed_ac2": {"activation_checkpointing": [BLOCK], "checkpoint_group_size": 2},
         "speed_ac_offload": {"activation_checkpointing": [BLOCK], "checkpoint_group_size": 2,
                              "activation_offload": True}}


# -- inside a case's process ------------------------------------------------------------------------------------
def deterministic(device_type: str) -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        for name in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(False)


def small(args) -> dict:
    return SMALL if args.accelerator == "cuda" else TINY


def model_and_tokens(cfg: dict, steps: int):
    import torch

    from lightning_mics.app.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["block"], n_layer=cfg["n_layer"],
                          n_head=cfg["n_head"], n_embd=cfg["n_embd"]))
    gen = torch.Generator().manual_seed(1)
    return model, torch.randint(0, cfg["vocab"], (steps, ACCUM, cfg["batch"], cfg["block"] + 1), generator=gen)


def lm_loss(logits, tokens):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def run_plain(args, precision: str, compiled: bool = False) -> dict:
    """One process, the whole global batch; fp16: autocast + GradScaler as Lightning's plugin does them."""
    import torch

    device = torch.device(args.accelerator)
    model, tokens = model_and_tokens(small(args), STEPS)
    model.to(device)
    if compiled:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fp16 = precision == "16-mixed"
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    scales = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            x = tokens[step, micro].to(device)
            with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
                logits = model(x[:, :-1])
            loss = lm_loss(logits, x) / ACCUM
            if fp16 and step == BLOW_UP:
                loss = loss * 1e30
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()) if fp16 else 1.0)
    return {"params": {k.removeprefix("_orig_mod."): v.detach().cpu() for k, v in model.state_dict().items()},
            "scales": scales}


def run_fabric(args, options: dict, precision: str, compiled: bool, processes: int) -> dict:
    import lightning as L
    import torch
    import lightning_mics_kernels._table as table
    from torch._dynamo.utils import counters

    from lightning_mics.fabric import MiCSStrategy

    lookups = [0]
    cached = table._cached

    def counting(key, build):
        lookups[0] += 1
        return cached(key, build)

    table._cached = counting  # every Triton copy looks its descriptor table up here (triton_kernels/_table.py)
    plugins, fp16 = None, precision == "16-mixed"
    if fp16 and args.accelerator == "cpu":  # Fabric makes 16-mixed bf16 on CPU
        from lightning.fabric.plugins.precision import MixedPrecision

        plugins, precision = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu")), None
    backend = "gloo" if processes > 1 else None
    fabric = L.Fabric(accelerator=args.accelerator, devices=1, num_nodes=processes, precision=precision,
                      plugins=plugins, strategy=MiCSStrategy(process_group_backend=backend, **options))
    fabric.launch()
    cfg = small(args)
    model, tokens = model_and_tokens(cfg, STEPS)
    if compiled:
        model = torch.compile(model)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    per = cfg["batch"] // fabric.world_size
    rows = slice(fabric.global_rank * per, (fabric.global_rank + 1) * per)
    scales, graphs, times = [], [], []
    for step in range(STEPS):
        start = time.perf_counter()
        for micro in range(ACCUM):
            x = tokens[step, micro, rows].to(fabric.device)
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = lm_loss(model(x[:, :-1]), x) / ACCUM
                if fp16 and step == BLOW_UP:
                    loss = loss * 1e30
                fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=not fp16)  # fp16: the scaler skips
        opt.step()
        opt.zero_grad()
        if fabric.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)
        graphs.append(int(counters["stats"]["unique_graphs"]))
    state = fabric.strategy.get_module_state_dict(model)
    state = {k.removeprefix("_orig_mod."): (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in state.items()}
    return {"params": state, "scales": scales, "graphs_after_step_1": graphs[0], "graphs_at_end": graphs[-1],
            "triton_table_lookups": lookups[0], "rank": fabric.global_rank,
            "step_ms_after_first": 1e3 * sum(times[1:]) / max(1, len(times) - 1)}


def run_speed(args, options: dict) -> dict:
    import lightning as L
    import torch

    from lightning_mics.fabric import MiCSStrategy

    cfg = dict(GPT2 if args.small == 0 else dict(small(args), n_layer=args.small), batch=args.batch)
    fabric = L.Fabric(accelerator=args.accelerator, devices=1, precision="bf16-mixed",
                      strategy=MiCSStrategy(**options))
    fabric.launch()
    model, tokens = model_and_tokens(cfg, args.warmup + args.steps)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    cuda = fabric.device.type == "cuda"
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        x = tokens[step, 0].to(fabric.device)
        fabric.backward(lm_loss(model(x[:, :-1]), x))
        opt.step()
        opt.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    return {"step_ms": 1e3 * (time.perf_counter() - start) / args.steps,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None, "rank": 0}


def probe(args) -> dict:
    """gloo's all-gather and reduce-scatter into one tensor and all-reduce, on this device's tensors."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.accelerator)
    x = torch.full((4,), float(rank + 1), device=device)
    out = {"rank": rank}
    checks = {COLLECTIVES[0]: lambda: dist.all_gather_into_tensor(torch.empty(4 * world, device=device), x),
              COLLECTIVES[1]: lambda: dist.reduce_scatter_tensor(torch.empty(2, device=device),
                                                                          torch.ones(2 * world, device=device)),
              COLLECTIVES[2]: lambda: dist.all_reduce(x.clone())}
    for name, call in checks.items():
        try:
            call()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001  (recorded: which collective gloo refuses on this device)
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    dist.destroy_process_group()
    return out


def case_main(args) -> None:
    import torch

    torch.set_num_threads(1)
    name = args.case
    if name in SPEED:
        result = run_speed(args, SPEED[name])
    elif name == "probe":
        result = probe(args)
    else:
        processes, options, precision, compiled = CASES[name]
        deterministic(args.accelerator)
        result = (run_plain(args, precision, compiled) if options is None
                  else run_fabric(args, options, precision, compiled, processes))
    if result.get("rank", 0) == 0:
        torch.save(result, Path(args.out) / f"{name}.pt")


# -- the driver ------------------------------------------------------------------------------------------------
def launch(args, name: str, processes: int, timeout: float) -> str:
    """Runs a case in `processes` fresh interpreters (torchrun-style variables, one process per "node"): ''
    when they all exit 0, else the first failing process's last lines."""
    from tests.helpers.launch import free_port

    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1" if args.accelerator == "cpu" else "0",
               CUBLAS_WORKSPACE_CONFIG=":4096:8", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(processes), LOCAL_RANK="0")
    cmd = [sys.executable, __file__, "--case", name, "--out", args.out, "--accelerator", args.accelerator,
           "--small", str(args.small), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch)]
    logs = [Path(args.out) / f"{name}.{r}.log" for r in range(processes)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as f:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(r), NODE_RANK=str(r), GROUP_RANK=str(r)),
                                          stdout=f, stderr=subprocess.STDOUT))
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p, log in zip(procs, logs):
        if p.wait() != 0:
            return f"{log.name} (rc {p.returncode}): " + " | ".join(log.read_text().splitlines()[-6:])
    return ""


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_checks"))
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", type=int, default=0, help="speed cases: 0 = GPT-2 124M, n = the small GPT, n blocks")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="speed cases: sequences per step")
    parser.add_argument("--rounds", type=int, default=1,
                        help="speed cases: run them this many times, interleaved, each time in fresh processes")
    parser.add_argument("--cases", nargs="+", help="these cases only (default: all)")
    parser.add_argument("--case-timeout", type=float, default=200.0, help="seconds per case")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.case:
        return case_main(args)
    import torch

    report = {"device": torch.cuda.get_device_name(0) if args.accelerator == "cuda" else "cpu",
              "torch": torch.__version__, "cases": {}}
    chosen = [n for n in ["probe", *CASES, *SPEED] if args.cases is None or n in args.cases]
    for name in [n for n in chosen if n not in SPEED]:
        report["cases"][name] = run_case(args, name, report["cases"])
        print(json.dumps({"case": name, **report["cases"][name]}), flush=True)
    speed = [n for n in chosen if n in SPEED]
    rows: Dict[str, List[dict]] = {name: [] for name in speed}
    for r in range(args.rounds):  # interleaved: a drift of the machine falls on every case alike
        for name in speed:
            rows[name].append(dict(run_case(args, name, report["cases"]), round=r + 1))
            print(json.dumps({"case": name, **rows[name][-1]}), flush=True)
    for name in speed:
        if args.rounds == 1:
            report["cases"][name] = rows[name][0]
            continue
        report["cases"][name] = summary = summarize(rows[name])
        print(json.dumps({"case": name, **{k: v for k, v in summary.items() if k != "rounds"}}), flush=True)
    (Path(args.out) / "gpu_checks.json").write_text(json.dumps(report, indent=1))


def run_case(args, name: str, done: Dict[str, dict]) -> dict:
    """One case in its own process(es): its result, compared with the plain process where it trained."""
    import torch

    processes = 2 if name == "probe" else CASES[name][0] if name in CASES else 1
    if name.startswith("two_") and any(done.get("probe", {}).get(k) != "ok" for k in COLLECTIVES):
        return {"error": "not run: gloo refused a collective on this device (probe)"}
    start = time.time()
    error = launch(args, name, processes, timeout=args.case_timeout)
    row: Dict[str, Any] = {"wall_s": round(time.time() - start, 1)}
    if error:
        return dict(row, error=error)
    got = torch.load(Path(args.out) / f"{name}.pt", weights_only=False)
    params = got.pop("params", None)
    if params is not None:
        ref = torch.load(Path(args.out) / ("fp16_plain.pt" if name == "fp16" else "plain.pt"), weights_only=False)
        row["max_abs_diff_vs_plain"] = max_diff(params, ref["params"])
        if name in SIBLING and (Path(args.out) / f"{SIBLING[name]}.pt").exists():
            sibling = torch.load(Path(args.out) / f"{SIBLING[name]}.pt", weights_only=False)["params"]
            row[f"max_abs_diff_vs_{SIBLING[name]}"] = max_diff(params, sibling)
        if name == "fp16":
            row["scales_equal_plain"] = got["scales"] == ref["scales"]
    row.update(got)
    return row


def summarize(rows: List[dict]) -> dict:
    """A speed case over its rounds: the median step and every round's, the highest peak."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return {"error": rows[-1]["error"], "rounds": rows}
    steps = [r["step_ms"] for r in ok]
    peaks = [r["peak_gb"] for r in ok if r["peak_gb"] is not None]
    return {"step_ms": statistics.median(steps), "step_ms_rounds": steps, "peak_gb": max(peaks) if peaks else None,
            "failed_rounds": len(rows) - len(ok), "rounds": rows}


if __name__ == "__main__":
    main()
