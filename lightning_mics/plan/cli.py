"""The planner's command line: ``python -m lightning_mics.plan`` and the ``lightning-mics-plan`` script.

An option left out is left to :class:`~lightning_mics.plan.settings.Settings` (and through it to
:class:`~lightning_mics.options.MiCSConfig`), so the defaults are written in one place.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Optional, Sequence

from lightning_mics.plan.report import plan
from lightning_mics.plan.settings import INSTANCES, OPTIMIZER_STATES, PRECISIONS

DESCRIPTION = "The planner: which sharding degree s, and what it costs, before a job starts."


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lightning_mics.plan", description=DESCRIPTION)
    ap.add_argument("--model", required=True, help="reference name (gpt-neox-20b, gpt-neox-65b, gpt2, llama-2-7b), "
                    "'gpt' or 'gpt:n_layer=8,n_embd=256' (the app's GPT), a count (20e9, 1.3B) or a config.json")
    ap.add_argument("--instance", choices=sorted(INSTANCES), help="sets the next four unless given")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--gpu-memory-gib", type=float)
    ap.add_argument("--intra-node-gbps", type=float, help="GB/s per GPU inside a node")
    ap.add_argument("--inter-node-gbps", type=float, help="GB/s per node across nodes")
    ap.add_argument("--precision", choices=PRECISIONS)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES))
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--accumulation", type=int)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--activation-offload", action="store_true")
    ap.add_argument("--no-flash-attention", dest="flash_attention", action="store_false")
    ap.add_argument("--prefetch", type=int)
    ap.add_argument("--max-live-parameters", type=float)
    ap.add_argument("--param-persistence-threshold", type=float)
    ap.add_argument("--tensor-parallel", dest="tensor_parallel_degree", type=int)
    ap.add_argument("--shard-optimizer-state", action="store_true",
                    help="SageMaker's optimizer state sharding (ZeRO-1): s = 1, optimizer state over all ranks")
    ap.add_argument("--quantize-gradients", choices=("true", "false", "error_feedback"),
                    help="the replica all-reduce in int8 blocks (error_feedback: with each rank's residual kept)")
    ap.add_argument("--quantize-allgather", action="store_true", default=None,
                    help="the cross-node hop of the two-hop gather in int8 blocks")
    ap.add_argument("--quantization-block-size", type=int, help="elements per fp32 scale")
    ap.add_argument("--replica-sync", choices=("exact", "diloco"),
                    help="diloco: the replica groups train apart and sync every --sync-every steps")
    ap.add_argument("--sync-every", type=int, help="DiLoCo's H: optimizer steps between outer syncs")
    ap.add_argument("--sync-fragments", type=int, help="streaming DiLoCo's F: one fragment synced every H / F steps")
    ap.add_argument("--headroom", type=float)
    ap.add_argument("--png", help="write the chart of memory per GPU against s here")
    return ap


def _settings(args: Dict[str, Any]) -> Dict[str, Any]:
    """The options given, as :class:`Settings` keywords (counts written as 1e9 become integers)."""
    for k in ("max_live_parameters", "param_persistence_threshold"):
        if args[k] is not None:
            args[k] = int(args[k])
    if args.get("quantize_gradients") in ("true", "false"):
        args["quantize_gradients"] = args["quantize_gradients"] == "true"
    return {k: v for k, v in args.items() if v is not None}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = vars(_parser().parse_args(argv))
    model, instance, png = args.pop("model"), args.pop("instance"), args.pop("png")
    try:
        result = plan(model, instance=instance, **_settings(args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result)
    if png:
        result.plot(png)
        print(f"\nchart: {png}")
    return 0
