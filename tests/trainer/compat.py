"""Lightning features under a strategy, one case after another in one process (one rank of a launch).

    python compat.py --out DIR --strategy mics|ddp|single --cases manual1,manual2,...

Each case builds its module with the same seed, trains with a real Trainer, and rank 0 saves what the test compares
against the control run (DDP, or "single": one plain Lightning process on the union of the ranks' batches):
``<case>.pt`` with the final parameters and the case's observations. ``mics``: MiCSStrategy(s=2), every
parameter sharded (param_persistence_threshold=0).
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import BackboneFinetuning  # noqa: E402
from lightning.pytorch.utilities.model_summary import ModelSummary  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import lightning_mics  # noqa: E402
from tests.helpers.comm_mode import CommCounter  # noqa: E402
from tests.helpers.models import C, D, V, Block  # noqa: E402
from tests.helpers.trainer_cases import (BATCH, T, Base, classification_data, loader, main, params,  # noqa: E402
                                         strategy_for, trainer_for)

# -- manual optimization -----------------------------------------------------------------------------------
class ManualOne(Base):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        sch = self.lr_schedulers()
        opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        sch.step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


class ManualAccum(Base):
    """Accumulation by hand: two backward passes (no zero_grad between them) per optimizer step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.loss(batch) / 2)
        if (batch_idx + 1) % 2 == 0:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


class Tower(nn.Module):
    """A root-owned input and output layer around two blocks (units)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.inp = nn.Linear(d_in, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(D, d_out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class GAN(L.LightningModule):
    """Two optimizers, toggle_optimizer, and a second generator forward after the generator's step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.G = Tower(8, 12)
        self.D = Tower(12, 1)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        g = torch.Generator().manual_seed(1000 * self.global_rank + batch_idx)
        z = torch.randn(real.size(0), 8, generator=g)
        ones, zeros = torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.D(self.G(z)), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = self.G(z).detach()  # with the generator's new weights
        d_loss = (F.binary_cross_entropy_with_logits(self.D(real), ones)
                  + F.binary_cross_entropy_with_logits(self.D(fake), zeros))
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return (torch.optim.SGD(self.G.parameters(), lr=0.1, momentum=0.9),
                torch.optim.SGD(self.D.parameters(), lr=0.1, momentum=0.9))


def gan_data(n):
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(n, 12, generator=g) @ torch.randn(12, 12, generator=g))


# -- the module called outside a step, the summary -------------------------------------------------------
PROBE = torch.arange(2 * T).view(2, T) % V


class CallsItself(Base):
    """Calls itself at every epoch end from its own hook (grad enabled, as Lightning leaves it)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_epoch_end(self):
        out = self(PROBE)
        self.seen.append(out.detach().clone())


class SampleCallback(L.Callback):
    """A sampling callback: the whole module and a root-owned submodule called directly, under no_grad."""

    def __init__(self):
        self.outputs, self.heads = [], []

    def on_train_epoch_end(self, trainer, pl_module):
        with torch.no_grad():
            self.outputs.append(pl_module(PROBE).clone())
            self.heads.append(pl_module.net.head(torch.ones(3, D)).clone())


class Summary(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        s = ModelSummary(pl_module, max_depth=2)
        self.total, self.trainable = s.total_parameters, s.trainable_parameters
        self.layers = dict(zip(s.layer_names, s.param_nums))


# -- the weights users get back --------------------------------------------------------------------------------
class BF16(Base):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


class Shards(L.Callback):
    """The masters as the strategy holds them at the end of training (DTensors: gathered in their own dtype)."""

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        self.full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for n, p in pl_module.named_parameters()}


class Finetune(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.backbone = nn.ModuleDict({"emb": nn.Embedding(V, D), "blocks": nn.ModuleList(Block() for _ in range(2))})
        self.head = nn.Linear(D, C)

    def forward(self, idx):
        x = self.backbone["emb"](idx)
        for b in self.backbone["blocks"]:
            x = b(x)
        return self.head(x.mean(1))

    def training_step(self, batch, batch_idx):
        idx, y = batch
        return F.cross_entropy(self(idx), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.2, momentum=0.9)


class LateReplica(Base):
    """The ranks of the second half step ``late_step`` a second late: the first half's all-gather of its updated
    optimizer rows (``mics_os``) is still in flight when those ranks go on, and stays so for that second."""
    late_step = -1

    def on_before_optimizer_step(self, optimizer):
        if self.global_step == self.late_step and self.global_rank >= self.trainer.world_size // 2:
            time.sleep(1.0)


class SomeRanks(Base):
    """A head that only the odd ranks' loss uses: on the even ranks it gets no gradient, so only the others' word
    (the summed "got a gradient" flags) says it has one; the odd ranks know it from their own
    ([Note: flags without a wait] in replicated.py)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(D, C)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.global_rank % 2:
            idx, y = batch
            loss = loss + F.cross_entropy(self.side(self.net.emb(idx).mean(1)), y)
        return loss


class AdamWImpl(Base):
    """AdamW as GPU users run it: torch's default there is ``foreach`` (one kernel over a list of tensors), litgpt
    asks for ``fused``; on CPU the default is the per-tensor loop, so these cases name the implementation. Over
    MiCS's DTensor parameters each is a different DTensor op (``_foreach_*`` lists, ``_fused_adamw_``)."""
    impl = "foreach"

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1, **{self.impl: True})


class UserCheckpoint(Base):
    """The model's own activation checkpointing, as HF's ``gradient_checkpointing_enable`` and nanoGPT-style
    models do it: each block called through ``torch.utils.checkpoint.checkpoint`` in forward, non-reentrant
    (torch's recommendation) or reentrant (the old default, still common). The blocks are units: the replay
    gathers them again inside backward."""
    reentrant = False

    def forward(self, idx):
        net = self.net
        x = net.emb(idx)
        for b in net.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.reentrant)
        return net.head(x.mean(1))


class TorchOptim(Base):
    """One of torch.optim's optimizers over every parameter (Muon: over the matrices, the only ones it takes), in
    torch's default implementation on CPU (one tensor at a time) or, with ``foreach``, the GPU's default."""
    optimizer, options = "SGD", {}

    def configure_optimizers(self):
        cls = getattr(torch.optim, self.optimizer)
        if self.optimizer == "Muon":
            return cls([p for p in self.parameters() if p.ndim == 2], lr=0.02, **self.options)
        return cls(self.parameters(), lr=0.01, **self.options)


# torch.optim's optimizers not in the other cases, each as it steps on CPU and as it steps on GPUs (foreach;
# LBFGS and Muon have one path); those that must be refused under MiCS with their options
# ([Note: optimizers over DTensors]).
TORCH_OPTIM = [(n, {}) for n in ["ASGD", "Adadelta", "Adagrad", "Adamax", "Muon", "NAdam", "RAdam", "RMSprop"]] + \
    [(n, {"foreach": True}) for n in ["ASGD", "Adadelta", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop"]]
REFUSED_OPTIM = {"LBFGS": ("LBFGS", {}), "Rprop": ("Rprop", {"foreach": False}),
                 "Rprop_foreach": ("Rprop", {"foreach": True}), "Adafactor": ("Adafactor", {}),
                 "Adafactor_foreach": ("Adafactor", {"foreach": True})}


class EvenRows(TorchOptim):
    """Every parameter's rows split evenly over 2 (the embedding's 38 rows: one unused): LBFGS runs here."""

    def __init__(self):
        super().__init__()
        self.net.emb = nn.Embedding(V + 1, D)


class GradNorms(Base):
    """Logs each parameter's gradient norm and their total in ``on_before_optimizer_step`` (2 and inf), as Lightning's
    docs show: Lightning's ``grad_norm`` under DDP, ``lightning_mics.grad_norm`` under MiCS (Lightning's fails on
    DTensor gradients). A frozen LayerNorm has no gradient. Records each call's collectives."""

    def __init__(self):
        super().__init__()
        self.net.blocks[0].ln.requires_grad_(False)
        self.fn = lightning_grad_norm
        self.norms, self.collectives = [], []

    def on_before_optimizer_step(self, optimizer):
        for norm_type in (2, "inf"):
            with CommCounter() as comm:
                norms = self.fn(self, norm_type=norm_type)
            self.log_dict(norms)
            self.norms.append({k: v.item() for k, v in norms.items()})
            self.collectives.append(len(comm.events))


class TunedLR(Base):
    """For Lightning's learning-rate finder: it sets ``self.lr``."""
    lr = 0.05

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Boom(LateReplica):
    """Fails on every rank right after its second optimizer step (Lightning's broadcast at the next batch's start
    would line the ranks up again): the first half a second before the second, its rows of that step still in
    flight (``mics_os``)."""
    late_step = 1

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom at step 2")


def run_case(case, kind, world, rank, out):
    L.seed_everything(0, verbose=False)
    result = {}
    if case == "manual1":
        m = ManualOne()
        trainer_for(kind, world, max_epochs=2).fit(m, loader(classification_data(8 * world * BATCH), kind, world, rank))
    elif case == "manual_accum":
        m = ManualAccum()
        trainer_for(kind, world, max_epochs=2).fit(m, loader(classification_data(8 * world * BATCH), kind, world, rank))
    elif case == "manual2":
        m = GAN()
        trainer_for(kind, world, max_epochs=2).fit(m, loader(gan_data(4 * world * BATCH), kind, world, rank))
    elif case in ("calls_itself", "calls_itself_bf16"):
        m = CallsItself()
        cb = SampleCallback()
        precision = "bf16-mixed" if case.endswith("bf16") else "32-true"
        trainer_for(kind, world, max_epochs=3, callbacks=[cb], precision=precision).fit(
            m, loader(classification_data(3 * world * BATCH), kind, world, rank))
        result.update(self_calls=torch.stack(m.seen), outputs=torch.stack(cb.outputs), heads=torch.stack(cb.heads))
        result["after_fit"] = m(PROBE).detach()
    elif case == "summary":
        m = Base()
        cb = Summary()
        trainer_for(kind, world, max_steps=1, callbacks=[cb]).fit(
            m, loader(classification_data(world * BATCH), kind, world, rank))
        result.update(total=cb.total, trainable=cb.trainable, layers=cb.layers,
                      plain=sum(p.numel() for p in Base().parameters()))
    elif case == "bf16":
        m = BF16()
        shards = Shards()
        trainer = trainer_for(kind, world, max_steps=4, precision="bf16-mixed", callbacks=[shards])
        trainer.fit(m, loader(classification_data(4 * world * BATCH), kind, world, rank))
        result.update(shards=shards.full, state_dict=trainer.strategy.lightning_module_state_dict())
    elif case == "finetune":
        m = Finetune()
        cb = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, verbose=False)
        trainer_for(kind, world, max_epochs=3, callbacks=[cb]).fit(
            m, loader(classification_data(2 * world * BATCH), kind, world, rank))
    elif case == "fail_refit":
        m = Boom()
        ds = classification_data(4 * world * BATCH)
        try:
            trainer_for(kind, world, max_steps=4).fit(m, loader(ds, kind, world, rank))
            raise AssertionError("the first fit did not raise")
        except RuntimeError as err:
            assert "boom at step 2" in str(err), err
        result["after_failure_plain"] = all(type(p) is nn.Parameter for p in m.parameters())
        m.__class__ = Base  # the user fixes the bug and fits again, in the same process
        trainer_for(kind, world, max_steps=4).fit(m, loader(ds, kind, world, rank))
    elif case in ("stays_sharded", "stays_sharded_bf16"):  # larger than max_live_parameters: stays sharded
        m = LateReplica()
        m.late_step = 2  # the last step: the first half's rows in flight as its fit ends
        mics = kind.startswith("mics")
        strategy = strategy_for(kind, max_live_parameters=3000) if mics else strategy_for(kind)
        precision = "bf16-mixed" if case.endswith("bf16") else "32-true"
        trainer = trainer_for(kind, world, max_steps=3, strategy=strategy, precision=precision)
        trainer.fit(m, loader(classification_data(3 * world * BATCH), kind, world, rank))
        result["stayed_sharded"] = any(type(p) is not nn.Parameter for p in m.parameters())
        names = {n for n, _ in m.named_parameters()}
        if mics:  # every rank's full state dict (each shard group's own gather): the replicas hold the same
            full = trainer.strategy.engine.full_state_dict(dst=None)
            every = [None] * world
            torch.distributed.all_gather_object(every, {n: t for n, t in full.items() if n in names})
            result["replicas"] = every
        result["params"] = {n: p for n, p in trainer.strategy.lightning_module_state_dict().items() if n in names}
    elif case == "some_ranks":
        m = SomeRanks()
        init = m.side.weight.detach().clone()
        trainer_for(kind, world, max_steps=4).fit(m, loader(classification_data(4 * world * BATCH), kind, world, rank))
        result["side_moved"] = (m.side.weight.detach() - init).abs().max().item()
    elif case in ("adamw_foreach", "adamw_fused"):  # with accumulation and clipping by norm, as litgpt runs it
        m = AdamWImpl()
        m.impl = case.removeprefix("adamw_")
        trainer_for(kind, world, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(
            m, loader(classification_data(8 * world * BATCH), kind, world, rank))
    elif case in ("user_checkpoint", "user_checkpoint_reentrant"):  # with accumulation and clipping by norm
        m = UserCheckpoint()
        m.reentrant = case.endswith("reentrant")
        trainer_for(kind, world, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(
            m, loader(classification_data(8 * world * BATCH), kind, world, rank))
    elif case == "torch_optim":  # each optimizer from the same initial values: {label: parameters after 3 steps}
        data = loader(classification_data(3 * world * BATCH), kind, world, rank)
        L.seed_everything(0, verbose=False)
        result["initial"] = params(TorchOptim())  # where every optimizer starts
        for name, options in TORCH_OPTIM:
            L.seed_everything(0, verbose=False)
            m = TorchOptim()
            m.optimizer, m.options = name, options
            trainer_for(kind, world, max_steps=3).fit(m, data)
            result[name + ("_foreach" if options else "")] = params(m)
    elif case == "lbfgs_even":  # LBFGS's closure evaluated up to 3 times per step (max_iter=3), every backward synced
        m = EvenRows()
        m.optimizer, m.options = "LBFGS", {"max_iter": 3}
        trainer = trainer_for(kind, world, max_steps=3)
        try:  # mics_os: the 19 rows of each chunk over 2 replicas are 10 and 9, refused on every rank alike
            trainer.fit(m, loader(classification_data(3 * world * BATCH), kind, world, rank))
        except ValueError as err:
            result["refused"] = f"{err} [after {trainer.global_step} steps]"
            m = Base()
    elif case == "rprop_kept_whole":  # what the refusal allows: the parameters whole (replicated), Rprop runs
        m = TorchOptim()
        m.optimizer = "Rprop"
        trainer_for(kind, world, max_steps=3, strategy=strategy_for(kind, param_persistence_threshold=10 ** 6)).fit(
            m, loader(classification_data(3 * world * BATCH), kind, world, rank))
    elif case == "refused_optim":  # {label: the error each rank's fit raised, before any step} (MiCS only)
        data = loader(classification_data(3 * world * BATCH), kind, world, rank)
        for label, (name, options) in REFUSED_OPTIM.items():
            m = TorchOptim()
            m.optimizer, m.options = name, options
            trainer = trainer_for(kind, world, max_steps=3)
            try:
                trainer.fit(m, data)
                result[label] = "not refused"
            except ValueError as err:
                result[label] = f"{err} [after {trainer.global_step} steps]"
        m = Base()  # then a fit in the same processes: the refusals left the process group usable
        initial = params(m)
        trainer_for(kind, world, max_steps=2).fit(m, data)
        result["moved_after"] = max((p.detach() - initial[n]).abs().max().item() for n, p in m.named_parameters())
    elif case == "grad_norm":  # with accumulation: logged at the boundary only
        m = GradNorms()
        if kind.startswith("mics"):
            m.fn = lightning_mics.grad_norm
        trainer = trainer_for(kind, world, max_steps=3, accumulate_grad_batches=2)
        trainer.fit(m, loader(classification_data(6 * world * BATCH), kind, world, rank))
        every = [None] * world
        torch.distributed.all_gather_object(every, m.norms)
        result.update(norms=every, collectives=m.collectives, logged=sorted(trainer.callback_metrics))
    elif case == "lr_find":  # Tuner.lr_find: a save, 20 steps, a restore and the removal of its checkpoint
        m = TunedLR()
        root = Path(out) / f"lr_find_{kind}"
        trainer = trainer_for(kind, world, max_steps=3, default_root_dir=str(root))
        data = loader(classification_data(40 * world * BATCH), kind, world, rank)
        found = Tuner(trainer).lr_find(m, train_dataloaders=data, min_lr=1e-4, max_lr=1.0, num_training=20)
        result.update(suggestion=found.suggestion(), lr=m.lr,
                      leftover=sorted(p.name for p in root.iterdir() if "lr_find" in p.name))
        trainer.fit(m, data)
    elif case == "lr_find_bf16":  # the same under bf16-mixed: its restore must bring back the fp32 masters
        m = TunedLR()
        initial = params(m)
        root = Path(out) / f"lr_find_bf16_{kind}"
        trainer = trainer_for(kind, world, max_steps=3, default_root_dir=str(root), precision="bf16-mixed")
        data = loader(classification_data(40 * world * BATCH), kind, world, rank)
        found = Tuner(trainer).lr_find(m, train_dataloaders=data, min_lr=1e-4, max_lr=1.0, num_training=20)
        restored = params(m)
        result.update(suggestion=found.suggestion(), lr=m.lr, candidates=list(found.results["lr"]),
                      leftover=sorted(p.name for p in root.iterdir() if "lr_find" in p.name),
                      restored=max((restored[k] - v).abs().max().item() for k, v in initial.items()),
                      restored_dtypes=sorted({str(t.dtype) for t in restored.values()}))
        trainer.fit(m, data)
        L.seed_everything(0, verbose=False)
        plain = TunedLR()  # the control: the same fit at the same rate, without the finder before it
        plain.lr = m.lr
        trainer_for(kind, world, max_steps=3, precision="bf16-mixed").fit(plain, data)
        result["without_finder"] = params(plain)
    elif case == "resume_bf16":
        ds = classification_data(3 * world * BATCH)  # 3 batches per epoch
        m = BF16()
        trainer_for(kind, world, max_epochs=2, precision="bf16-mixed").fit(m, loader(ds, kind, world, rank))
        result["uninterrupted"] = params(m)
        L.seed_everything(0, verbose=False)
        m = BF16()
        ckpt = Path(out) / f"resume_bf16_{kind}.ckpt"
        trainer = trainer_for(kind, world, max_epochs=1, precision="bf16-mixed")
        trainer.fit(m, loader(ds, kind, world, rank))
        trainer.save_checkpoint(ckpt)
        L.seed_everything(1, verbose=False)
        m = BF16()  # other initial values: everything must come from the checkpoint
        trainer_for(kind, world, max_epochs=2, precision="bf16-mixed").fit(m, loader(ds, kind, world, rank),
                                                                         ckpt_path=str(ckpt))
    else:
        raise ValueError(case)
    result.setdefault("params", params(m))
    result["param_types"] = sorted({type(p).__name__ for p in m.parameters()})
    return result


if __name__ == "__main__":
    main(run_case)
