"""Lightning's own sharded-strategy tests, ported to CPU with MiCSStrategy in FSDP's / ModelParallel's place.

    python lightning_ported.py --out DIR --strategy mics|ddp --cases stages_sharded_32,save_opt_2,...

The cases follow Lightning's ``tests/tests_pytorch/strategies/test_fsdp.py``, ``test_model_parallel_integration.py``
and the multi-device cases of ``trainer/optimization/test_manual_optimization.py`` (Lightning 2.6), keeping their
assertions; FSDP-only internals (``FullyShardedDataParallel`` instances, its ``mixed_precision``) are translated to
their intent under MiCS (every parameter a DTensor shard during the loops, the gather dtype of the precision).
Each case also runs under Lightning's DDP (``--strategy ddp``, the control: the same seed and data) and rank 0
saves ``<case>.pt`` with what the test compares: final parameters, optimizer state, predictions. Every rank
writes ``result<rank>.json`` with the errors per case and what it observed (e.g. state-dict sizes off rank 0).
MiCS runs with every parameter sharded (``param_persistence_threshold=0``) unless a case says otherwise.
"""

import argparse
import json
import os
import sys
import traceback
from copy import deepcopy
from pathlib import Path

import torch
import torch.distributed as torch_distrib
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset  # noqa: E402
from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchmetrics import Accuracy  # noqa: E402

from lightning_mics import MiCSStrategy  # noqa: E402
from tests.helpers.bf16_policy import Bf16Copies  # noqa: E402

KIND = "mics"
LIMITS = dict(limit_train_batches=4, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


def strategy(**kw):
    """MiCS in FSDP's place (every parameter sharded), or Lightning's DDP for the control run."""
    if KIND == "ddp":
        kw.pop("state_dict_type", None)
        assert not kw, kw
        return "ddp"
    kw.setdefault("param_persistence_threshold", 0)
    return MiCSStrategy(**kw)


def trainer(tmp, **kw):
    kw.setdefault("strategy", strategy())
    if KIND == "ddp" and kw.get("precision") == "bf16-mixed":  # the control runs MiCS's precision policy
        kw["callbacks"] = [*kw.get("callbacks", []), Bf16Copies()]
    return Trainer(default_root_dir=tmp, accelerator="cpu", devices=2, **kw)


def assert_sharded(module):
    """FSDP's ``_assert_layer_fsdp_instance``: during the loops the module is sharded (MiCS: every parameter a
    DTensor shard between units' use) and the strategy's precision plugin gathers in the precision's dtype."""
    if KIND != "mics":
        return
    assert all(isinstance(p, DTensor) for p in module.layer.parameters()), "a parameter is not sharded"
    want = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    precision = module.trainer.precision
    if precision in want:
        gathered = module.trainer.strategy.engine.options.param_dtype or torch.float32  # None: the master dtype
        assert gathered == want[precision], (gathered, precision)


def plain(sd):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone() for k, v in sd.items()}


def params_of(module):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for n, p in module.named_parameters()}


def optimizer_consistent(trainer_, module):
    """Every parameter an optimizer holds is one of the module's own (the issue-30 invariant)."""
    own = {id(p) for p in module.parameters()}
    for opt in trainer_.strategy.optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for g in opt.param_groups:
            for p in g["params"]:
                assert id(p) in own, f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not the module's"


# -- models (Lightning's, with the FSDP wrapping left out: MiCS shards without it) ---------------------------------
class TestFSDPModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer = None

    def configure_model(self):
        if self.layer is None:
            self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

    def on_train_batch_start(self, batch, batch_idx):
        assert batch.dtype == torch.float32

    def on_train_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        assert_sharded(self)

    def on_test_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        assert_sharded(self)

    def on_validation_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        assert_sharded(self)

    def on_predict_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        assert_sharded(self)


class TestBoringModel(BoringModel):
    def __init__(self, wrap_min_params: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class TestFSDPModelAutoWrapped(TestBoringModel):
    def on_train_batch_end(self, _, batch, batch_idx):
        assert batch.dtype == torch.float32
        if self.hparams.wrap_min_params == 0:
            assert_sharded(self)


class TestFSDPCheckpointModel(BoringModel):
    def __init__(self, params_to_compare=None):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        self.params_to_compare = params_to_compare

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def on_train_start(self):
        if self.params_to_compare is None:
            return
        for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters()):
            p1 = p1.full_tensor() if isinstance(p1, DTensor) else p1
            torch.testing.assert_close(p0, p1, atol=0, rtol=0, equal_nan=True)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class TemplateModel(LightningModule):
    """test_model_parallel_integration.py's model (its ``FSDP2Model`` is this one, parallelized in configure_model)."""

    def __init__(self):
        super().__init__()
        self.model = FeedForward()

    def training_step(self, batch):
        return self.model(batch).sum()

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


# -- the flows Lightning's _run_multiple_stages runs ---------------------------------------------------------------
def _run_multiple_stages(trainer_, model, model_path, out):
    """Lightning's ``_run_multiple_stages``, plus what the issue compares against DDP: the predictions under
    ``inference_mode``, and parameters and optimizer state after resuming from the after-test checkpoint."""
    trainer_.fit(model)
    trainer_.test(model)
    optimizer_consistent(trainer_, model)
    model_path = trainer_.strategy.broadcast(model_path)
    model_path = Path(model_path if model_path else trainer_.checkpoint_callback.last_model_path)
    trainer_.save_checkpoint(model_path.with_name("after-test"))
    trainer_.save_checkpoint(model_path, weights_only=True)
    if not model_path.is_dir():
        model_state_dict = trainer_.strategy.lightning_module_state_dict()
        if trainer_.is_global_zero:
            saved_model = model.__class__.load_from_checkpoint(model_path)
            saved_model.configure_model()
            for ddp_param, shard_param in zip(model_state_dict.values(), saved_model.state_dict().values()):
                assert torch.equal(ddp_param, shard_param)
    with torch.inference_mode():
        trainer_.test(model)
        trainer_.test(ckpt_path=model_path)
        first = trainer_.predict(model)
        second = trainer_.predict(ckpt_path=model_path)
    return model_path, {"predict": torch.cat(first).cpu(), "predict_ckpt": torch.cat(second).cpu()}


def resumed(tmp, model_cls, path, precision, state_dict_type):
    """A new model resumed from ``path`` for one more epoch: its parameters and full optimizer state."""
    seed_everything(1)
    model = model_cls()
    t = trainer(tmp, max_epochs=2, precision=precision, strategy=strategy(state_dict_type=state_dict_type), **LIMITS,
                **QUIET)
    t.fit(model, ckpt_path=path)
    optimizer_consistent(t, model)
    opt = model.optimizers(use_pl_optimizer=False)
    return {"params": params_of(model), "opt": deepcopy(opt.state_dict())}


def case_stages(tmp, state_dict_type, precision):
    """test_fsdp.py::test_strategy_checkpoint (state_dict_type x precision)."""
    seed_everything(0)
    kw = {} if KIND == "ddp" else {"strategy": strategy(state_dict_type=state_dict_type)}
    t = trainer(tmp, precision=precision, max_epochs=1, **LIMITS, **QUIET, **kw)
    model = TestFSDPModel()
    path, res = _run_multiple_stages(t, model, str(tmp / "last.ckpt"), tmp)
    after = resumed(tmp, TestFSDPModel, str(path.with_name("after-test")), precision, state_dict_type)
    return {**res, **{f"resumed_{k}": v for k, v in after.items()}}


def case_multi(tmp, variant):
    """test_fsdp.py::test_checkpoint_multi_gpus: ModelCheckpoint(save_last=True), every stage. FSDP's variants are
    wrapping policies; MiCS's are its unit choices: the automatic one, and every Linear a unit of its own."""
    seed_everything(0)
    units = {"manual": None, "linear": ["torch.nn.Linear"]}[variant]
    kw = {} if KIND == "ddp" else {"strategy": strategy(shard_units=units, state_dict_type="full")}
    t = trainer(tmp, precision="32-true", max_epochs=1, callbacks=[ModelCheckpoint(save_last=True)], **LIMITS,
                **QUIET, **kw)
    model = TestFSDPModel() if variant == "manual" else TestFSDPModelAutoWrapped()
    if variant == "linear":
        model.configure_model = lambda: None
    _, res = _run_multiple_stages(t, model, None, tmp)
    return res


def case_full_state_dict(tmp, wrap_min_params, facts):
    """test_fsdp.py::test_strategy_full_state_dict. FSDP wraps modules of at least ``wrap_min_params``; MiCS keeps
    parameters below ``param_persistence_threshold`` replicated: the same three regimes (all, some, none)."""
    seed_everything(0)
    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    correct_state_dict = model.state_dict()
    kw = {} if KIND == "ddp" else {"strategy": strategy(param_persistence_threshold=wrap_min_params,
                                                          state_dict_type="full")}
    t = trainer(tmp, precision="16-mixed", max_epochs=1, barebones=True, **LIMITS, **kw)
    t.fit(model)
    full_state_dict = t.strategy.lightning_module_state_dict()
    facts["len"] = len(full_state_dict)
    if t.global_rank != 0:
        assert len(full_state_dict) == 0
        return {}
    assert len(correct_state_dict) == len(full_state_dict)
    assert list(full_state_dict.keys()) == list(correct_state_dict.keys())
    return {"state_dict": plain(full_state_dict)}


def _fit_save(tmp, model, kw, path):
    t = trainer(tmp, max_epochs=1, **LIMITS, **kw)
    t.fit(model)
    path = t.strategy.broadcast(str(path))
    t.save_checkpoint(path)
    return t, path, t.strategy.lightning_module_state_dict(), t.strategy.optimizer_state(model.optimizers())


def _assert_equal_on_zero(t, sd, opt_sd, restored_sd, restored_opt):
    if t.global_rank == 0:
        assert len(sd) == len(restored_sd) and len(opt_sd) == len(restored_opt)
        torch.testing.assert_close(sd, restored_sd, atol=0, rtol=0)
        torch.testing.assert_close(opt_sd, restored_opt, atol=0, rtol=0)
    t.strategy.barrier()


def case_save_opt(tmp, model_cls, threshold, precision, facts):
    """test_fsdp.py::test_strategy_save_optimizer_states and test_model_parallel_integration.py::
    test_load_full_state_checkpoint_into_regular_model: a full MiCS checkpoint restores into DDP exactly."""
    seed_everything(0)
    model = model_cls()
    kw = {"strategy": strategy(state_dict_type="full", param_persistence_threshold=threshold), "barebones": True,
          "precision": precision}
    t, path, sd, opt_sd = _fit_save(tmp, model, kw, tmp / "last.ckpt")
    facts.update(sd=len(sd), opt=len(opt_sd))
    if t.global_rank != 0:
        assert len(sd) == 0 and len(opt_sd) == 0
    model = model_cls()
    t = trainer(tmp, strategy="ddp", max_epochs=1, **LIMITS, **QUIET)
    t.fit(model, ckpt_path=path)
    restored = t.strategy.lightning_module_state_dict(), t.strategy.optimizer_state(model.optimizers())
    _assert_equal_on_zero(t, sd, opt_sd, *restored)
    return {}


def case_load_opt(tmp, model_cls, threshold, precision, facts):
    """test_fsdp.py::test_strategy_load_optimizer_states and test_model_parallel_integration.py::
    test_load_standard_checkpoint_into_distributed_model: a DDP checkpoint restores into MiCS exactly."""
    seed_everything(0)
    model = model_cls()
    t, path, sd, opt_sd = _fit_save(tmp, model, {"strategy": "ddp", **QUIET}, tmp / "last.ckpt")
    model = model_cls()
    kw = {"strategy": strategy(state_dict_type="full", param_persistence_threshold=threshold), "barebones": True,
          "precision": precision}
    t = trainer(tmp, max_epochs=1, **LIMITS, **kw)
    t.fit(model, ckpt_path=path)
    restored = t.strategy.lightning_module_state_dict(), t.strategy.optimizer_state(model.optimizers())
    facts.update(sd=len(restored[0]), opt=len(restored[1]))
    if t.global_rank != 0:
        assert len(restored[0]) == 0 and len(restored[1]) == 0
    _assert_equal_on_zero(t, sd, opt_sd, *restored)
    return {}


def case_configure_model(tmp):
    """test_fsdp.py::test_configure_model (32-true): the module built in configure_model is on the CPU in
    configure_model and on the strategy's device, in the precision's dtype, at on_fit_start."""
    expected_dtype = torch.float32

    class MyModel(BoringModel):
        def configure_model(self):
            self.layer = nn.Linear(32, 2)
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == expected_dtype

        def configure_optimizers(self):
            return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

        def on_fit_start(self):
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == expected_dtype

    trainer(tmp, precision="32-true", max_epochs=1, enable_checkpointing=False, **LIMITS, **QUIET).fit(MyModel())
    return {}


def case_init_context(tmp, precision):
    """test_fsdp.py::test_module_init_context and test_model_parallel_integration.py::test_module_init_context:
    under ``trainer.init_module`` the parameters are on the CPU (or meta with empty_init) in the precision's dtype,
    and after setup the parameters and the optimizer's are on the device in that dtype."""
    expected_dtype = {"32-true": torch.float32, "16-true": torch.float16, "bf16-true": torch.bfloat16}[precision]

    class Model(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def on_train_start(self):
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == expected_dtype
            optimizer = self.optimizers(use_pl_optimizer=False)
            assert optimizer.param_groups[0]["params"][0].device.type == "cpu"

    for empty_init, expected_device in ((False, torch.device("cpu")), (True, torch.device("meta"))):
        t = trainer(tmp, precision=precision, max_steps=1, barebones=True, enable_checkpointing=False, logger=False)
        with t.init_module(empty_init=empty_init):
            model = Model()
        assert model.layer.weight.device == expected_device
        assert model.layer.weight.dtype == expected_dtype
        t.fit(model)
    return {}


def case_sharded_sd(tmp, model_kind):
    """test_fsdp.py::test_save_load_sharded_state_dict and test_model_parallel_integration.py::
    test_save_load_sharded_state_dict: the checkpoint callback writes a sharded directory (one file per rank, a
    metadata file without the states), and training resumes from it with the parameters it left."""
    seed_everything(0)

    class FFCheckpointModel(TemplateModel):
        def __init__(self, params_to_compare=None):
            super().__init__()
            self.params_to_compare = params_to_compare

        on_train_start = TestFSDPCheckpointModel.on_train_start

    cls = TestFSDPCheckpointModel if model_kind == "boring" else FFCheckpointModel
    kw = dict(max_epochs=1, **QUIET, limit_train_batches=4, limit_val_batches=2)
    t = trainer(tmp, strategy=strategy(state_dict_type="sharded"), **kw)
    t.fit(cls())
    params_before = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in t.model.parameters()]
    checkpoint_path = Path(t.strategy.broadcast(t.checkpoint_callback.best_model_path))
    files = sorted(os.listdir(checkpoint_path))
    assert set(files) == {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}, files
    metadata = torch.load(checkpoint_path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(metadata["callbacks"]) == 1
    assert "state_dict" not in metadata
    assert "optimizer_states" not in metadata
    kw.update(max_epochs=2)
    t = trainer(tmp, strategy=strategy(state_dict_type="sharded"), **kw)
    t.fit(cls(params_to_compare=params_before), ckpt_path=checkpoint_path)
    return {}


def case_save_over(tmp):
    """test_model_parallel.py::test_save_checkpoint_path_exists (pytorch's), as tests/fabric/fabric_ported.py's:
    ``trainer.save_checkpoint`` replaces a file or a checkpoint of either form; a directory holding other files is
    refused on every rank with an ``IsADirectoryError`` and left as it was."""
    trainers = {}
    for fmt in ("full", "sharded"):
        trainers[fmt] = trainer(tmp, strategy=strategy(state_dict_type=fmt), max_steps=1, **LIMITS, **QUIET)
        trainers[fmt].fit(BoringModel())
    for fmt, t in trainers.items():
        base = Path(t.strategy.broadcast(str(tmp / fmt)))
        other = base / "not-a-checkpoint"
        if t.global_rank == 0:
            other.mkdir(parents=True)
            (other / "notes.txt").write_text("keep")
            (base / "over-file").write_bytes(b"old")
        t.strategy.barrier()
        try:
            t.save_checkpoint(other)
            raise AssertionError(f"{fmt}: a save replaced a directory holding other files")
        except IsADirectoryError as err:
            assert "exists and is a directory" in str(err) and "notes.txt" in str(err), err
        assert (other / "notes.txt").read_text() == "keep"
        for before in ("file", "full", "sharded"):  # what the path holds before this save
            if before != "file":
                trainers[before].save_checkpoint(base / f"over-{before}")
            t.save_checkpoint(base / f"over-{before}")
            assert (base / f"over-{before}").is_dir() == (fmt == "sharded"), (fmt, before)
    return {}


class RecordingIO(TorchCheckpointIO):
    """Lightning's default plugin, recording the paths it is handed (a user's own CheckpointIO)."""

    def __init__(self):
        super().__init__()
        self.saved, self.loaded = [], []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved.append(str(path))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path, *args, **kwargs):
        self.loaded.append(str(path))
        return super().load_checkpoint(path, *args, **kwargs)


def case_checkpoint_io(tmp):
    """test_fsdp.py / test_model_parallel.py::test_checkpoint_io_unsupported, as MiCS decides it: a CheckpointIO
    plugin acts with ``state_dict_type="full"`` (rank 0 hands it the user's path, every rank loads through it;
    Lightning's ``AsyncCheckpointIO`` writes ModelCheckpoint's files, there when fit ends) and is refused with the
    sharded form, which it would not see (on every rank, when the Trainer is made)."""
    params = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    io = RecordingIO()
    t = trainer(tmp, strategy=strategy(state_dict_type="full"), plugins=[io], max_steps=2, enable_checkpointing=False,
                **LIMITS, **QUIET)
    model = BoringModel()
    t.fit(model)
    path = Path(t.strategy.broadcast(str(tmp / "io" / "full.ckpt")))
    t.save_checkpoint(path)
    assert io.saved == ([str(path)] if t.global_rank == 0 else []), io.saved
    t.strategy.barrier()
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert all(torch.equal(saved[n], v) for n, v in params(model).items())
    io2 = RecordingIO()
    t2 = trainer(tmp, strategy=strategy(state_dict_type="full"), plugins=[io2], max_steps=3, enable_checkpointing=False,
                 **LIMITS, **QUIET)
    t2.fit(BoringModel(), ckpt_path=str(path))
    assert str(path) in io2.loaded and t2.global_step == 3, (io2.loaded, t2.global_step)
    dirpath = Path(t.strategy.broadcast(str(tmp / "io" / "async")))
    t3 = trainer(tmp, strategy=strategy(state_dict_type="full"), plugins=[AsyncCheckpointIO()], max_steps=2,
                 callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)], **LIMITS, **QUIET)
    model = BoringModel()
    t3.fit(model)
    last = torch.load(dirpath / "last.ckpt", weights_only=False)
    assert last["global_step"] == 2 and all(torch.equal(last["state_dict"][n], v) for n, v in params(model).items())
    try:
        trainer(tmp, strategy=strategy(), plugins=[RecordingIO()], max_steps=1)
        raise AssertionError("a CheckpointIO plugin was accepted with sharded checkpoints")
    except ValueError as err:
        assert "checkpoint_io=RecordingIO with state_dict_type='sharded'" in str(err), err
    return {}


def case_size_mismatch(tmp):
    """Beyond Lightning's tests: ``fit(ckpt_path=...)`` of a sharded checkpoint into a module whose parameters have
    other shapes is refused on every rank as ``load_state_dict`` refuses it (each entry, both shapes), before any
    collective of the read; Lightning's sharded strategies leave it to DCP (its traceback as the message)."""
    t = trainer(tmp, max_steps=1, enable_checkpointing=False, **LIMITS, **QUIET)
    t.fit(BoringModel())
    path = Path(t.strategy.broadcast(str(tmp / "size" / "sharded")))
    t.save_checkpoint(path)
    wider = BoringModel()
    wider.layer = nn.Linear(32, 3)
    try:
        trainer(tmp, max_steps=2, enable_checkpointing=False, **LIMITS, **QUIET).fit(wider, ckpt_path=str(path))
        raise AssertionError("a checkpoint loaded into a module of other shapes")
    except RuntimeError as err:
        assert "size mismatch for ['layer.weight: checkpoint (2, 32), module (3, 32)', 'layer.bias: checkpoint " \
               "(2,), module (3,)']" in str(err), err
    return {}


def case_consolidate(tmp):
    """test_fsdp.py::test_save_sharded_and_consolidate_and_load: the consolidation of the sharded directory gives
    a file DDP resumes from. Lightning's consolidation reads its FSDP layout ("model", "optimizer_0" keys); MiCS's
    directory keys the module's own state dict names, and ``lightning_mics.consolidate`` is its consolidation."""
    from lightning_mics import consolidate

    class CustomModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

    seed_everything(0)
    t = trainer(tmp, strategy=strategy(state_dict_type="sharded"), max_steps=3, **LIMITS, **QUIET)
    t.fit(CustomModel())
    sharded = t.strategy.broadcast(str(t.checkpoint_callback.best_model_path))
    assert set(os.listdir(sharded)) == {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}
    full = t.strategy.broadcast(str(tmp / "checkpoint_full.ckpt"))
    if t.global_rank == 0:
        torch.save(consolidate(sharded), full)
    t.strategy.barrier()
    model = CustomModel()
    t = trainer(tmp, strategy="ddp", max_steps=4, **LIMITS, **QUIET)
    t.fit(model, ckpt_path=full)
    assert t.global_step == 4
    return {"params": params_of(model)}


def case_no_params(tmp):
    """test_fsdp.py / test_model_parallel_integration.py::test_modules_without_parameters: a torchmetrics metric
    (no parameters, only states) is moved to the device with the module."""

    class MetricsModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def setup(self, stage):
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            assert self.metric.device == self.metric.tp.device == torch.device("cpu")
            self.metric(torch.rand(2, 10, device=self.device), torch.randint(0, 10, size=(2,), device=self.device))
            return loss

    trainer(tmp, max_steps=1, **QUIET).fit(MetricsModel())
    return {}


CASES = {
    **{f"stages_{t}_{p}": (lambda tmp, f, t=t, p=p: case_stages(tmp, t, p))
       for t in ("sharded", "full") for p in ("32-true", "bf16-mixed")},
    **{f"multi_{v}": (lambda tmp, f, v=v: case_multi(tmp, v)) for v in ("manual", "linear")},
    **{f"full_sd_{n}": (lambda tmp, f, n=n: case_full_state_dict(tmp, n, f)) for n in (0, 1024, 100_000_000)},
    **{f"save_opt_{n}": (lambda tmp, f, n=n: case_save_opt(tmp, TestBoringModel, n, "16-mixed", f))
       for n in (0, 1024, 100_000_000)},
    **{f"load_opt_{n}": (lambda tmp, f, n=n: case_load_opt(tmp, TestBoringModel, n, "16-mixed", f))
       for n in (0, 1024, 100_000_000)},
    "save_opt_ff": lambda tmp, f: case_save_opt(tmp, TemplateModel, 0, "32-true", f),
    "load_opt_ff": lambda tmp, f: case_load_opt(tmp, TemplateModel, 0, "32-true", f),
    "configure_model": lambda tmp, f: case_configure_model(tmp),
    **{f"init_{p}": (lambda tmp, f, p=p: case_init_context(tmp, p)) for p in ("32-true", "16-true", "bf16-true")},
    "sharded_sd_boring": lambda tmp, f: case_sharded_sd(tmp, "boring"),
    "sharded_sd_ff": lambda tmp, f: case_sharded_sd(tmp, "ff"),
    "consolidate": lambda tmp, f: case_consolidate(tmp),
    "save_over": lambda tmp, f: case_save_over(tmp),
    "checkpoint_io": lambda tmp, f: case_checkpoint_io(tmp),
    "size_mismatch": lambda tmp, f: case_size_mismatch(tmp),
    "no_params": lambda tmp, f: case_no_params(tmp),
}


def run(cases, kind, out, table):
    """Runs ``cases`` one after another; rank 0 saves each case's result, every rank its errors and facts."""
    global KIND
    KIND = kind
    rank = int(os.environ["RANK"])
    errors, facts = {}, {}
    for case in cases:
        tmp = Path(out) / case
        tmp.mkdir(exist_ok=True)
        facts[case] = {}
        try:
            result = table[case](tmp, facts[case])
            if rank == 0:
                torch.save(result, Path(out) / f"{case}.pt")
        except Exception:
            errors[case] = traceback.format_exc()
            print(f"case {case}:\n{errors[case]}", flush=True)
        if torch_distrib.is_initialized():
            torch_distrib.barrier()
    (Path(out) / f"result{rank}.json").write_text(json.dumps({"errors": errors, "facts": facts}))


def main(table=CASES):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", required=True, choices=["mics", "ddp"])
    ap.add_argument("--cases", required=True)
    args = ap.parse_args()
    run(args.cases.split(","), args.strategy, args.out, table)


if __name__ == "__main__":
    main()
