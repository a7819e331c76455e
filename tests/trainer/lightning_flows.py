"""Lightning users' flows (inference mode, fit-test-save, ...) and Lightning's multi-device manual-optimization
tests, under MiCS and under DDP.

    python lightning_flows.py --out DIR --strategy mics|ddp --cases inference_mode,seq_small_fit-test-save,...

Runs like ``lightning_ported.py`` (same launcher, same result files); rank 0 saves what the tests compare
against the DDP run on the same seed and data: predictions, test losses, parameters, optimizer state.
"""

import collections
import sys
from copy import deepcopy
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as torch_distrib
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch import seed_everything  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

import tests.trainer.lightning_ported as lp  # noqa: E402
from lightning_mics import consolidate  # noqa: E402


# -- manual optimization (test_manual_optimization.py) ------------------------------------------------------------
def assert_empty_grad(grad):
    if grad is not None:
        grad = grad.full_tensor() if isinstance(grad, lp.DTensor) else grad
        assert torch.all(grad == 0), "the gradient was not zeroed"


class ManualOptimizationExtendedModel(BoringModel):
    detach = False

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.count = 0
        self.called = collections.defaultdict(int)

    @property
    def should_update(self):
        return self.count % 2 == 0

    def on_train_batch_start(self, batch, batch_idx):
        self.called["on_train_batch_start"] += 1
        self.weight_before = lp.params_of(self)["layer.weight"]

    def training_step(self, batch, batch_idx):
        self.called["training_step"] += 1
        opt = self.optimizers()
        loss = self.step(batch)
        loss /= loss.clone().detach()
        loss *= 0.1
        if self.should_update:
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
        return loss.detach() if self.detach else loss

    def on_train_batch_end(self, *_):
        self.called["on_train_batch_end"] += 1
        after = lp.params_of(self)["layer.weight"]
        if self.should_update:
            assert not torch.equal(self.weight_before, after), self.count
        else:
            assert torch.equal(self.weight_before, after)
        assert_empty_grad(self.layer.weight.grad)
        self.count += 1

    def on_train_end(self):
        assert self.called["training_step"] == 10
        assert self.called["on_train_batch_start"] == 10
        assert self.called["on_train_batch_end"] == 10


def case_manual_return_tensor(tmp):
    """test_manual_optimization_and_return_tensor (2 devices, 16-mixed): a returned loss adds no gradient."""
    seed_everything(0)
    model = ManualOptimizationExtendedModel()
    t = lp.trainer(tmp, max_epochs=1, limit_train_batches=10, limit_test_batches=0, limit_val_batches=0,
                   precision="16-mixed", **lp.QUIET)
    t.fit(model)
    return {"params": lp.params_of(model)}


class TesManualOptimizationDDPModel(BoringModel):
    """Two optimizers on the same parameters, stepped with closures at different frequencies, each closure running
    two backward passes through one graph (``retain_graph``)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def loss_ones(self, batch, prediction):
        return F.mse_loss(prediction, torch.ones_like(prediction))

    def manual_sync_grad(self):
        """DDP's check that the gradient is already averaged (an all-reduce changes nothing). Under MiCS the
        gradient the optimizer sees is this rank's shard of the averaged one; the test compares the parameters
        with DDP's instead, which holds only if every step saw the averaged gradient."""
        if lp.KIND != "ddp":
            return True
        torch_distrib.all_reduce(self.layer.weight.grad.data, async_op=False)
        return True

    def compute_loss(self, batch):
        x = F.dropout(batch[0], 0.1)
        predictions = F.dropout(self(x), 0.1)
        return self.loss_ones(None, predictions)

    def make_manual_backward(self, loss, retain_graph=False, make_optimizer_step=True):
        world_size = torch_distrib.get_world_size(torch_distrib.group.WORLD)
        self.manual_backward(loss, retain_graph=retain_graph)
        if make_optimizer_step and lp.KIND == "ddp":
            grad_clone = self.layer.weight.grad.clone()
            assert self.manual_sync_grad()
            self.layer.weight.grad /= world_size
            assert torch.equal(self.layer.weight.grad, grad_clone)

    def closure(self, batch, make_step):
        def run():
            loss = self.compute_loss(batch)
            self.make_manual_backward(loss, retain_graph=True, make_optimizer_step=make_step)
            self.make_manual_backward(loss, make_optimizer_step=make_step)
        return run

    def training_step(self, batch, batch_idx):
        opt_gen, opt_dis = self.optimizers()
        assert torch_distrib.get_world_size(torch_distrib.group.WORLD) == 2
        make_gen_optimizer_step = batch_idx % 2 == 1
        make_dis_optimizer_step = batch_idx % 4 == 0
        if make_gen_optimizer_step:
            opt_gen.step(closure=self.closure(batch, make_gen_optimizer_step))
            opt_gen.zero_grad()
        if make_dis_optimizer_step:
            opt_dis.step(closure=self.closure(batch, make_dis_optimizer_step))

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.Adam(self.layer.parameters(), lr=0.001)]

    def on_train_start(self):
        sgd, adam = self.optimizers()
        self.sgd_step_patch = patch.object(sgd, "step", wraps=sgd.step)
        self.sgd_step_mock = self.sgd_step_patch.start()
        self.adam_step_patch = patch.object(adam, "step", wraps=adam.step)
        self.adam_step_mock = self.adam_step_patch.start()

    def on_train_end(self):
        self.sgd_step_patch.stop()
        assert self.sgd_step_mock.call_count == 4
        self.adam_step_patch.stop()
        assert self.adam_step_mock.call_count == 2


class TestManualOptimizationDDPModelToggleModel(TesManualOptimizationDDPModel):
    def training_step(self, batch, batch_idx):
        opt_gen, opt_dis = self.optimizers()
        make_gen_optimizer_step = batch_idx % 2 == 1
        make_dis_optimizer_step = batch_idx % 4 == 0
        with opt_gen.toggle_model(sync_grad=make_gen_optimizer_step):
            self.closure(batch, make_gen_optimizer_step)()
            if make_gen_optimizer_step:
                opt_gen.step()
                opt_gen.zero_grad()
        with opt_dis.toggle_model(sync_grad=make_dis_optimizer_step):
            self.closure(batch, make_dis_optimizer_step)()
            if make_dis_optimizer_step:
                opt_dis.step()
                opt_dis.zero_grad()


def case_manual_frequencies(tmp, model_cls):
    """test_step_with_optimizer_closure_with_different_frequencies_ddp (and ..._with_toggle_model)."""
    seed_everything(42)
    model = model_cls()
    model_copy = deepcopy(model)
    model.val_dataloader = None
    t = lp.trainer(tmp, limit_train_batches=8, limit_val_batches=2, max_epochs=1, log_every_n_steps=1, **lp.QUIET)
    t.fit(model)
    got = lp.params_of(model)
    for name, param_copy in model_copy.named_parameters():
        assert not torch.equal(got[name], param_copy.data)
    return {"params": got}


# -- users' flows -------------------------------------------------------------------------------------------------
class FlowModel(lp.TestFSDPModel):
    """Built in ``__init__``: a module first built by configure_model inside the user's ``inference_mode`` holds
    inference tensors under DDP, which then cannot fit (MiCS's shards are normal tensors either way)."""

    def __init__(self):
        super().__init__()
        self.configure_model()

    def test_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss


def _evaluate(t, model, ctx, out, tag):
    with ctx():
        out[f"{tag}_test"] = t.test(model, verbose=False)[0]["test_loss"]
        out[f"{tag}_predict"] = torch.cat(t.predict(model)).cpu()
    lp.optimizer_consistent(t, model)


def case_inference(tmp, ctx_name):
    """test and predict under ``inference_mode`` / ``no_grad``, before and after fit, then a second fit."""
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}[ctx_name]
    seed_everything(0)
    model = FlowModel()
    t = lp.trainer(tmp, max_epochs=1, **lp.LIMITS, **lp.QUIET)
    out = {}
    _evaluate(t, model, ctx, out, "before")
    t.fit(model)
    _evaluate(t, model, ctx, out, "after")
    t.fit_loop.max_epochs = 2
    t.fit(model)  # trains on: inference tensors anywhere in the module would make it fail
    lp.optimizer_consistent(t, model)
    out["params"] = lp.params_of(model)
    return out


def case_sequence(tmp, size, ops):
    """Any order of the entry points on one Trainer: after each, the optimizers hold only the module's parameters;
    at the end, parameters and the consolidated optimizer state equal DDP's. ``large``: the model stays sharded
    between the entry points (max_live_parameters=1); ``small``: it is made plain after each."""
    seed_everything(0)
    model = FlowModel()
    kw = {"max_live_parameters": 1} if size == "large" else {}
    t = lp.trainer(tmp, strategy=lp.strategy(**kw) if lp.KIND == "mics" else "ddp", max_epochs=0, **lp.LIMITS,
                   **lp.QUIET)
    for i, op in enumerate(ops.split("-")):
        if op == "fit":
            t.fit_loop.max_epochs += 1
            t.fit(model)
        elif op == "save":
            t.save_checkpoint(t.strategy.broadcast(str(tmp / f"save{i}")))
        else:
            getattr(t, op)(model, verbose=False) if op != "predict" else t.predict(model)
        lp.optimizer_consistent(t, model)
    path = t.strategy.broadcast(str(tmp / "final"))
    t.save_checkpoint(path)
    params = lp.params_of(model)  # collective while the module stays sharded
    if t.global_rank != 0:
        return {}
    state = consolidate(path) if Path(path).is_dir() else torch.load(path, weights_only=False)
    return {"params": params, "state_dict": state["state_dict"],
            "optimizer": state["optimizer_states"][0] if state.get("optimizer_states") else None}


SEQUENCES = ["fit-test-save", "fit-validate-test-predict-save-fit", "test-fit-save", "predict-validate-fit-test-fit",
             "fit-save-test-save-fit"]
CASES = {
    "manual_return_tensor": lambda tmp, f: case_manual_return_tensor(tmp),
    "manual_frequencies": lambda tmp, f: case_manual_frequencies(tmp, TesManualOptimizationDDPModel),
    "manual_toggle": lambda tmp, f: case_manual_frequencies(tmp, TestManualOptimizationDDPModelToggleModel),
    **{f"inference_{c}": (lambda tmp, f, c=c: case_inference(tmp, c)) for c in ("inference_mode", "no_grad")},
    **{f"seq_{size}_{ops}": (lambda tmp, f, size=size, ops=ops: case_sequence(tmp, size, ops))
       for size in ("small", "large") for ops in SEQUENCES},
}

if __name__ == "__main__":
    lp.main(CASES)
