"""litgpt's pretraining loop (``litgpt/pretrain.py``: ``setup`` + ``fit``) on a small ``GPT`` under MiCS.

The only change against litgpt's own script is the strategy: where it builds
``FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD", ...)`` for more than one device, this
uses ``lightning_mics.fabric.MiCSStrategy(sharded_data_parallel_degree=s, shard_units=[Block])``. Everything else
is litgpt's pattern: the model created under ``fabric.init_module(empty_init=True)`` with litgpt's
``initialize_weights`` (each rank initializes only its shards), ``fabric.setup`` then ``fabric.setup_optimizers``,
``fabric.no_backward_sync(model, enabled=is_accumulating)`` around every micro-batch (MiCS: reduce-scatter in the
sharding group each time, the replica all-reduce only at the last one), ``fabric.clip_gradients`` and
``fabric.save``.

    torchrun --nproc-per-node 4 examples/fabric_litgpt/pretrain.py --sharded-degree 2 --accum 4  # CPU: --accelerator cpu

No download: the config is ``Config.from_name("pythia-14m", ...)`` with small overrides and the data random tokens.
"""

from __future__ import annotations

import argparse
import math
from functools import partial
from pathlib import Path
from typing import Any, Dict

import lightning as L
import torch
import torch.nn as nn
from litgpt import Config
from litgpt.model import GPT, Block, CausalSelfAttention, LLaMAMLP
from litgpt.utils import chunked_cross_entropy

import lightning_mics  # noqa: F401  (registers "mics" for Fabric too)
from lightning_mics.fabric import MiCSStrategy


def config(n_layer: int = 2) -> Config:
    return Config.from_name("pythia-14m", n_layer=n_layer, n_embd=32, n_head=4, block_size=16, vocab_size=96,
                            padded_vocab_size=96, intermediate_size=64)


def initialize_weights(model: GPT, n_layer: int, n_embd: int) -> None:
    """litgpt's ``initialize_weights`` (GPT-NeoX init): sets each module's ``reset_parameters``, which sharded
    initialization runs on this rank's shards at ``fabric.setup``."""

    def init_weights(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.Linear)):
            mod.reset_parameters = partial(init_weights, mod, std=math.sqrt(2.0 / 5 / n_embd))
    for mod in model.modules():
        if isinstance(mod, (LLaMAMLP, CausalSelfAttention)):
            mod.proj.reset_parameters = partial(init_weights, mod.proj, std=(1 / math.sqrt(n_embd) / n_layer))


def setup(fabric: L.Fabric, cfg: Config, lr: float = 4e-3, fused: bool | None = None,
          compile: bool = True) -> Dict[str, Any]:
    """``fused``: AdamW's fused implementation; by default litgpt's choice (on CUDA only). ``compile``:
    ``torch.compile`` the model before ``fabric.setup``, as litgpt does."""
    fabric.seed_everything(42)
    with fabric.init_module(empty_init=True):
        model = GPT(cfg)
    initialize_weights(model, n_layer=cfg.n_layer, n_embd=cfg.n_embd)
    if compile:
        model = torch.compile(model)
    model = fabric.setup(model)
    fused = fabric.device.type == "cuda" if fused is None else fused
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    optimizer = fabric.setup_optimizers(optimizer)
    return {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}


def fit(fabric: L.Fabric, state: Dict[str, Any], batches: torch.Tensor, accum: int, max_norm: float = 1.0) -> None:
    """litgpt's ``fit`` loop without logging and validation: ``batches`` holds this rank's micro-batches of
    ``block_size + 1`` tokens, one per iteration."""
    model, optimizer = state["model"], state["optimizer"]
    for train_data in batches:
        state["iter_num"] += 1
        input_ids = train_data[:, 0: model.max_seq_length].contiguous().long()
        targets = train_data[:, 1: (model.max_seq_length + 1)].contiguous().long()
        is_accumulating = state["iter_num"] % accum != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets)
            fabric.backward(loss / accum)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=max_norm)
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--devices", default="auto")
    ap.add_argument("--sharded-degree", type=int, default=None,
                    help="sharded_data_parallel_degree (default: ranks per node)")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--save", type=Path, default=None, help="fabric.save the state here at the end")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (litgpt compiles the model)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="checkpoint litgpt's Blocks")
    args = ap.parse_args()
    strategy = MiCSStrategy(sharded_data_parallel_degree=args.sharded_degree, shard_units=[Block],
                            param_persistence_threshold=0,
                            activation_checkpointing=[Block] if args.activation_checkpointing else None)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    cfg = config()
    state = setup(fabric, cfg, compile=not args.no_compile)
    g = torch.Generator().manual_seed(1000 + fabric.global_rank)
    batches = torch.randint(0, cfg.vocab_size, (args.steps * args.accum, args.micro_batch, cfg.block_size + 1),
                            generator=g).to(fabric.device)
    fit(fabric, state, batches, args.accum)
    fabric.print(f"{state['step_count']} optimizer steps; model state held by rank 0: "
                 f"{fabric.strategy.model_state_bytes(state['model'].module, [state['optimizer']])}")
    if args.save is not None:
        fabric.save(args.save, state)


if __name__ == "__main__":
    main()
