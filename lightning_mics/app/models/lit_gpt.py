"""The example LightningModule: a plain GPT trained on bytes. Nothing in it knows about the strategy.

It is the "unchanged LightningModule" of the design card: the same file trains under any strategy. It builds
the model in ``__init__``, logs the training loss every step and the validation loss and perplexity
(``torchmetrics.text.Perplexity``) synchronised over ranks, and optimises with AdamW (parameter groups by
name: no weight decay for biases, LayerNorm and embedding weights) under a linear warmup followed by a cosine
decay to ``min_lr_ratio * lr``. With ``compile=True`` each transformer block is ``torch.compile``d in place
(``Block.compile()``, torchtitan's per-block compile: the parameter names, and so the checkpoints, stay those
of the eager model; a strategy's module hooks stay outside the compiled graphs).

[Note: the schedule on resume]
The learning rate follows this run's settings: ``model.lr``, ``model.warmup_steps``, ``model.min_lr_ratio`` and
the schedule's length, ``trainer.max_steps``. A resumed run whose settings differ from the checkpoint's (say a
longer ``trainer.max_steps`` to train further) continues on the schedule it would have had from the start with
these settings, from its first step on (the optimizer's restored learning rate is replaced before it), and the
rank-0 log says what changed and how the learning rate jumps at the resume step (``[lr] ...``). With the
checkpoint's own settings nothing changes and the run continues bit for bit.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import lightning as L
import torch
import torch.nn as nn
from torchmetrics.text import Perplexity

from lightning_mics.app.models.gpt import GPT, GPTConfig

_log = logging.getLogger("lightning_mics.app")


def no_decay_names(module: nn.Module) -> Set[str]:
    """Names (as ``module.named_parameters()`` gives them) of biases and of LayerNorm and embedding weights.

    Computed once from module types on the plain model, then matched by name, so that it does not depend on
    the shape a strategy gives the parameters later (a sharded parameter may be flat)."""
    skip = {id(p) for m in module.modules() if isinstance(m, (nn.LayerNorm, nn.Embedding)) for p in m.parameters()}
    return {n for n, p in module.named_parameters() if n.endswith("bias") or id(p) in skip}


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear from ~0 to 1 over ``warmup_steps``, then cosine to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LitGPT(L.LightningModule):
    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = True,
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 20,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                                   n_embd=n_embd, dropout=dropout, bias=bias, tie_weights=tie_weights))
        self._no_decay = {f"model.{n}" for n in no_decay_names(self.model)}
        if compile:
            for block in self.model.h:
                block.compile()
        self.val_ppl = Perplexity()
        self._schedule_steps = 0  # the schedule's length, trainer.max_steps (configure_optimizers)
        self._resumed: Optional[Dict[str, Any]] = None  # the checkpoint's schedule settings, when resuming

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_ppl.update(logits.float(), y)
        self.log("val/loss", self._loss(logits, y), prog_bar=True, sync_dist=True)
        self.log("val/ppl", self.val_ppl, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Dict[str, Any]:
        hp = self.hparams
        named = list(self.named_parameters())
        decay = [p for n, p in named if n not in self._no_decay and p.requires_grad]
        no_decay = [p for n, p in named if n in self._no_decay and p.requires_grad]
        groups: List[Dict[str, Any]] = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        total = self._schedule_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["lr_schedule_steps"] = self._schedule_steps

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        hp = checkpoint.get("hyper_parameters", {})
        self._resumed = {"trainer.max_steps": checkpoint.get("lr_schedule_steps"), "model.lr": hp.get("lr"),
                         "model.warmup_steps": hp.get("warmup_steps"), "model.min_lr_ratio": hp.get("min_lr_ratio")}

    def on_train_start(self) -> None:
        """[Note: the schedule on resume]: the restored learning rate replaced by this run's schedule's."""
        if self._resumed is None:
            return
        hp, scheduler = self.hparams, self.lr_schedulers()
        step = scheduler.last_epoch
        new = hp.lr * warmup_cosine(step, hp.warmup_steps, self._schedule_steps, hp.min_lr_ratio)
        old = scheduler.optimizer.param_groups[0]["lr"]
        if math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-15) and scheduler.base_lrs[0] == hp.lr:
            return
        scheduler.base_lrs = [hp.lr] * len(scheduler.base_lrs)
        for group in scheduler.optimizer.param_groups:
            group["lr"], group["initial_lr"] = new, hp.lr
        scheduler._last_lr = [new] * len(scheduler.base_lrs)
        if self.trainer.is_global_zero:
            now = {"trainer.max_steps": self._schedule_steps, "model.lr": hp.lr,
                   "model.warmup_steps": hp.warmup_steps, "model.min_lr_ratio": hp.min_lr_ratio}
            changed = ", ".join(f"{k} {self._resumed[k]:g} -> {v:g}" for k, v in now.items()
                                if self._resumed[k] is not None and self._resumed[k] != v)
            _log.warning(f"[lr] resuming at optimizer step {step} on a learning-rate schedule unlike the checkpoint's "
                         f"({changed or 'settings not recorded in the checkpoint'}): the learning rate goes from "
                         f"{old:.3g} (the checkpoint's schedule) to {new:.3g} at this step and follows this run's "
                         f"warmup + cosine decay to step {self._schedule_steps}. To keep the checkpoint's schedule, "
                         f"resume with its settings.")
