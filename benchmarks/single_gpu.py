"""One device, no peers to talk to: what the strategy costs over the bare module (tokens/s, MFU, peak memory).

    python benchmarks/single_gpu.py                                 # on a GPU: GPT-2 124M and a small GPT
    python benchmarks/single_gpu.py --configs tiny --steps 6 --warmup 2 --accelerator cpu   # a quick check

At s = r = 1 MiCS has nobody to shard with, so anything it adds is overhead. With s = 1 every parameter stays whole
(a replicated DTensor, placement.py), so no bucket is gathered or copied and ``kernels`` has nothing to choose
between; what is left is DTensor parameters (the optimizer's foreach ops go through DTensor's dispatch, as they do
under FSDP2), the engine's hooks, and Lightning's own loop. Cases, each in its own process (a fresh CUDA context
and allocator), the same model, initial weights, batches and AdamW:

- ``bare``: a plain PyTorch loop (``torch.autocast`` for the mixed precision, as Lightning's plugin does);
- ``lightning``: ``Trainer(strategy="auto")`` (Lightning's single-device strategy);
- ``ddp``: ``Trainer(strategy="ddp", devices=1)``;
- ``fsdp``: ``Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}))`` (FSDP1, GPU only);
- ``fsdp2``: ``Trainer(strategy=ModelParallelStrategy())`` with FSDP2's ``fully_shard`` on each Block and the root
  in ``configure_model`` (Lightning's FSDP2 path; DTensor parameters, as MiCS's are);
- ``mics``: ``Trainer(strategy="mics")``, defaults.

Per case: time of the steps after ``--warmup`` (the device synchronized at both ends), tokens/s, model FLOPs
utilization (6 N + 12 L T d FLOPs per token, PaLM's count with attention, against the device's dense bf16 peak),
peak allocated device memory, and the parameters after the run against ``bare``'s (||p - p_bare|| / ||p_bare||
over the whole model: every case trains the same model on the same batches; on a GPU, ``lightning`` against
``bare`` shows the spread of the device's nondeterministic kernels). Rounds run the cases in turn (``--rounds``); the median is taken.
Writes ``<out>/single_gpu.md``, ``single_gpu.json`` and ``single_gpu.png``; prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("bare", "lightning", "ddp", "fsdp", "fsdp2", "mics")
CONFIGS = {  # name: (n_layer, n_head, n_embd, vocab, block_size, batch)
    "gpt2-124m": (12, 12, 768, 50257, 1024, 8),
    "small": (4, 4, 256, 8192, 512, 16),
    "tiny": (2, 2, 64, 256, 32, 4),
}
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense; the first name found


def model_and_batches(config: str, steps: int, seed: int = 0):
    import torch

    from lightning_mics.app.models import GPT, GPTConfig

    n_layer, n_head, n_embd, vocab, block, batch = CONFIGS[config]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (steps, batch, block + 1), generator=gen)
    return model, tokens


def flops_per_token(model, config: str) -> float:
    n_layer, _, n_embd, _, block, _ = CONFIGS[config]
    return 6 * model.num_params() + 12 * n_layer * block * n_embd


def run_case(case: str, config: str, steps: int, warmup: int, accelerator: str) -> dict:
    """One case in this process; returns its figures and the file its trained parameters were saved to."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    model, tokens = model_and_batches(config, steps)
    fpt = flops_per_token(model, config)
    cuda = accelerator == "gpu"
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    marks: dict = {}
    if case == "bare":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        for i in range(steps):
            if i == warmup:
                sync()
                marks["t0"] = time.perf_counter()
            batch = tokens[i].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model.loss(batch[:, :-1], batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        marks["t1"] = time.perf_counter()
        params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    else:
        params = _lightning_case(case, model, tokens, warmup, accelerator, marks, sync)
    elapsed = marks["t1"] - marks["t0"]
    timed = steps - warmup
    tok_s = timed * tokens.shape[1] * (tokens.shape[2] - 1) / elapsed
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return {"case": case, "config": config, "device": name, "params": model.num_params(),
            "step_s": elapsed / timed, "tokens_per_s": tok_s, "mfu": tok_s * fpt / peak if peak else None,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "params_file": _save(params, case, config)}


def _save(params: dict, case: str, config: str) -> str:
    """The trained parameters, for the parent's comparison (a scratch file: GPT-2 124M is 0.5 GB)."""
    import torch

    path = Path(os.environ["SINGLE_GPU_SCRATCH"]) / f"{case}-{config}.pt"
    torch.save({n: p.contiguous() for n, p in sorted(params.items())}, path)
    return str(path)


def _lightning_case(case, model, tokens, warmup, accelerator, marks, sync):
    import lightning as L
    import torch

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                sync()
                marks["t0"] = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            sync()
            marks["t1"] = time.perf_counter()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def configure_model(self):
            if case == "fsdp2":  # FSDP2 as its docs apply it: each block, then the root; fp32 parameters under autocast
                from torch.distributed.fsdp import fully_shard

                from lightning_mics.app.models.gpt import Block

                mesh = self.device_mesh["data_parallel"]
                for block in [m for m in self.model.modules() if isinstance(m, Block)]:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return self.model.loss(batch[:, :-1], batch[:, 1:])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    if case == "mics":
        from lightning_mics import MiCSStrategy

        strategy = MiCSStrategy()
    elif case == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_mics.app.models.gpt import Block

        strategy = FSDPStrategy(auto_wrap_policy={Block})
    elif case == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    else:
        strategy = {"lightning": "auto", "ddp": "ddp"}[case]
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=tokens.shape[0], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()],
                        use_distributed_sampler=False)  # the same batches in the same order for every case
    module = Module()
    loader = torch.utils.data.DataLoader(list(tokens), batch_size=None, shuffle=False)
    trainer.fit(module, loader)
    if case == "fsdp":
        state = trainer.strategy.lightning_module_state_dict()
        return {n.removeprefix("model."): t.detach().float().cpu() for n, t in state.items()}
    if case == "fsdp2":  # one rank: each DTensor's full tensor is its local one
        return {n: p.detach().full_tensor().float().cpu() for n, p in model.named_parameters()}
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}  # MiCS: gathered back after fit


def child(args) -> None:
    print("RESULT " + json.dumps(run_case(args.case, args.config, args.steps, args.warmup, args.accelerator)))


def spawn(case: str, config: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--case", case, "--config", config, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--accelerator", args.accelerator]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               SINGLE_GPU_SCRATCH=args.scratch)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.case_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"case": case, "config": config, "error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1][len("RESULT "):])


def compare(res: dict, ref: dict, ref_sq: float) -> float | None:
    """||p - p_bare|| / ||p_bare|| over the whole model (every parameter in one vector); ``ref``: the bare loop's
    parameters, ``ref_sq``: their squared norm (both loaded and computed once per config)."""
    import torch

    if "params_file" not in res:
        return None
    a = torch.load(res["params_file"])
    if not ref.keys() <= a.keys():  # (a state dict may also name a tied weight twice: lm_head.weight)
        return float("inf")
    diff = sum(float((a[n].double() - ref[n].double()).pow(2).sum()) for n in ref)
    return (diff / ref_sq) ** 0.5


def report(rows: list[dict], out: Path) -> str:
    lines = []
    for config in dict.fromkeys(r["config"] for r in rows):
        per = [r for r in rows if r["config"] == config and "error" not in r]
        if not per:
            continue
        lines += [f"\n{config}: {per[0]['params'] / 1e6:.1f}M parameters, {per[0]['device']}\n",
                  "| case | step ms | tokens/s | / bare | MFU | peak GB | params vs bare (rel) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        bare = next((r for r in per if r["case"] == "bare"), None)
        for r in per:
            ratio = f"{r['tokens_per_s'] / bare['tokens_per_s']:.3f}" if bare else ""
            mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else ""
            mem = f"{r['peak_mem_gb']:.2f}" if r.get("peak_mem_gb") is not None else ""
            diff = r.get("vs_bare")
            lines.append(f"| {r['case']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | {ratio} | {mfu} | "
                         f"{mem} | {'' if diff is None else f'{diff:.1e}'} |")
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['case']} ({r['config']}) failed: {r['error'][-600:]!r}")
    text = "\n".join(lines) + "\n"
    (out / "single_gpu.md").write_text(text)
    return text


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows if "error" not in r))
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 3.5), squeeze=False)
    for ax, config in zip(axes[0], configs):
        per = [r for r in rows if r["config"] == config and "error" not in r]
        bare = next((r for r in per if r["case"] == "bare"), per[0])
        ax.bar([r["case"] for r in per], [r["tokens_per_s"] / bare["tokens_per_s"] for r in per])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{config} ({per[0]['device']})", fontsize=9)
        ax.set_ylabel("tokens/s / bare loop")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "single_gpu.png", dpi=120)


def run_all(cases: list[str], args) -> list[dict]:
    rows: list[dict] = []
    for config in args.configs:
        runs: dict = {c: [] for c in cases}
        for _ in range(args.rounds):
            for case in cases:
                runs[case].append(spawn(case, config, args))
        for case in cases:
            ok = [r for r in runs[case] if "error" not in r]
            if not ok:
                rows.append(runs[case][0])
                continue
            best = ok[0] | {"step_s": statistics.median(r["step_s"] for r in ok),
                            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                            "rounds": len(ok)}
            if best.get("mfu") is not None:
                best["mfu"] = statistics.median(r["mfu"] for r in ok)
            rows.append(best)
        bare = next((r for r in rows if r["config"] == config and r["case"] == "bare" and "error" not in r), None)
        if bare is not None:
            import torch

            ref = torch.load(bare["params_file"])
            ref_sq = sum(float(t.double().pow(2).sum()) for t in ref.values())
            for r in rows:
                if r["config"] == config:
                    r["vs_bare"] = compare(r, ref, ref_sq)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["gpt2-124m", "small"], choices=sorted(CONFIGS))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    p.add_argument("--case-timeout", type=float, default=600)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if not 0 < args.warmup < args.steps:
        p.error(f"--warmup={args.warmup} must be in [1, --steps={args.steps})")
    cases = [c for c in args.cases if not (c == "fsdp" and args.accelerator == "cpu")]  # FSDPStrategy: GPU only
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = scratch
        rows = run_all(cases, args)
    for r in rows:
        r.pop("params_file", None)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "error"} | ({"error": r["error"][-300:]} if "error" in r else {})))
    (args.out / "single_gpu.json").write_text(json.dumps(rows, indent=1))
    print(report(rows, args.out))
    plot(rows, args.out)


if __name__ == "__main__":
    main()
