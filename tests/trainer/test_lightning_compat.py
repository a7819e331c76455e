"""Lightning features under MiCS equal a control on the same data and seed.

One launch per (strategy, world) runs every case of ``tests/trainer/compat.py`` in one process per rank; the
tests compare the final parameters (and what each case observed) against DDP, or against one plain Lightning
process on the union of the ranks' batches where DDP is no control: DDP never reduces a parameter that was
frozen when it was built, so BackboneFinetuning under DDP lets the ranks drift apart.
MiCS runs with s = 2 and every parameter sharded (param_persistence_threshold=0), on 2 ranks (r = 1) and on 4
ranks (r = 2); on 4 ranks also with ``shard_optimizer_state=True`` (``mics_os``: the optimizer's rows over the 2
replicas, their all-gather after every step).
"""

import pytest
import torch

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "trainer" / "compat.py"
CASES = ["manual1", "manual_accum", "manual2", "calls_itself", "calls_itself_bf16", "summary", "bf16", "fail_refit", "stays_sharded",
         "stays_sharded_bf16", "resume_bf16", "some_ranks", "adamw_foreach", "adamw_fused", "user_checkpoint",
         "lr_find", "lr_find_bf16", "torch_optim", "lbfgs_even",
         "rprop_kept_whole", "grad_norm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(strategy, world): folder of <case>.pt}; launched once for the whole module."""
    out = {}

    def get(kind, world):
        key = (kind, world)
        if key not in out:
            d = tmp_path_factory.mktemp(f"{kind}{world}")
            if kind == "single":
                res = run_ranks(SCRIPT, 1, ["--strategy", "single", "--cases", "finetune"], d,
                                extra_env={"DATA_WORLD": str(world)})
            else:
                cases = CASES + (["finetune"] if kind == "mics" else []) + \
                    (["user_checkpoint_reentrant", "refused_optim"] if kind.startswith("mics") else [])  # DDP: no
                res = run_ranks(SCRIPT, world, ["--strategy", kind, "--cases", ",".join(cases)], d)
            errors = {c: e for r in res for c, e in r["errors"].items()}
            out[key] = (d, errors)
        return out[key]
    return get


def load(runs, kind, world, case):
    d, errors = runs(kind, world)
    assert case not in errors, f"{kind} on {world} ranks, case {case}:\n{errors[case]}"
    return torch.load(d / f"{case}.pt", weights_only=False)


def rel(a, b):
    return (a.float() - b.float()).norm().item() / max(b.float().norm().item(), 1e-12)


def assert_params_close(got, ref, tol, moved_from=None):
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert rel(got[name], ref[name]) <= tol, (name, rel(got[name], ref[name]))


WORLDS = [2, 4]
MICS = [("mics", 2), ("mics", 4), ("mics_os", 4)]


@pytest.mark.parametrize("kind, world", MICS)
@pytest.mark.parametrize("case", ["manual1", "manual_accum", "manual2"])
def test_manual_optimization_equals_ddp(runs, kind, world, case):
    """One optimizer with clip_gradients and a scheduler; accumulation by hand (two backward passes, no zero_grad
    between them); two optimizers with toggle_optimizer and a forward after a step inside one training_step."""
    got, ref = load(runs, kind, world, case), load(runs, "ddp", world, case)
    assert_params_close(got["params"], ref["params"], 1e-6)
    assert got["param_types"] == ["Parameter"]  # plain again after fit


@pytest.mark.parametrize("kind, world", MICS)
def test_module_called_outside_steps_equals_ddp(runs, kind, world):
    """The module called from its own on_train_epoch_end (grad enabled) and from a sampling callback (the whole
    module, and a root-owned submodule directly) sees full parameters: same outputs as under DDP."""
    got, ref = load(runs, kind, world, "calls_itself"), load(runs, "ddp", world, "calls_itself")
    for key in ("self_calls", "outputs", "heads", "after_fit"):
        assert got[key].shape == ref[key].shape, key  # e.g. (3 epochs, 2, 32): all 32 classes, not a shard's 16
        assert rel(got[key], ref[key]) <= 1e-5, key
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
def test_module_called_outside_steps_under_bf16_mixed_runs_as_its_training_forward(runs, kind, world):
    """The same under bf16-mixed ([Note: calls outside the precision's context] in lightning_mics/engine/hooks.py): the
    callbacks run outside Lightning's autocast, and the root-owned head called on an fp32 tensor met its bf16
    copies without it (``mat1 and mat2 must have the same dtype``). Now such a call runs under autocast, as the
    training forward: its output is bf16, within bf16's rounding of DDP's, which computes outside autocast in fp32
    (2.2e-3 to 3.0e-3 measured); the module after fit and the training equal DDP's under MiCS's precision
    policy."""
    got, ref = load(runs, kind, world, "calls_itself_bf16"), load(runs, "ddp", world, "calls_itself_bf16")
    for key in ("self_calls", "outputs", "heads"):
        assert got[key].dtype == torch.bfloat16 and ref[key].dtype == torch.float32, key
        assert got[key].shape == ref[key].shape, key
        assert rel(got[key], ref[key]) <= 1e-2, key
    assert rel(got["after_fit"], ref["after_fit"]) <= 1e-6
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("world", WORLDS)
def test_model_summary_counts_full_parameters(runs, world):
    got, ref = load(runs, "mics", world, "summary"), load(runs, "ddp", world, "summary")
    assert got["total"] == ref["total"] == got["plain"]
    assert got["trainable"] == ref["trainable"]
    assert got["layers"] == ref["layers"]


@pytest.mark.parametrize("kind, world", MICS)
def test_bf16_mixed_returns_fp32_masters(runs, kind, world):
    got, ref = load(runs, kind, world, "bf16"), load(runs, "ddp", world, "bf16")
    sd = got["state_dict"]
    for name, p in got["params"].items():
        # bit for bit the masters the strategy held at the end of training (gathered in their own dtype)
        assert torch.equal(p, got["shards"][name]), name
        assert torch.equal(sd[name], p), name  # lightning_module_state_dict() after fit
        assert p.dtype == torch.float32
    values = torch.cat([p.reshape(-1) for p in got["params"].values()])
    bf16_exact = (values.view(torch.int32) & 0xFFFF == 0).float().mean().item()
    assert bf16_exact < 0.01, f"{bf16_exact:.3f} of the values are exactly representable in bfloat16"
    # Against DDP's fp32 masters, DDP running MiCS's precision policy (tests/helpers/bf16_policy.py): bit for bit
    # (0.0 measured). Under autocast alone DDP runs LayerNorm and the embedding on fp32 weights where MiCS gathers
    # every parameter in bf16, and AdamW normalizes the small differences on tiny-gradient biases: 0.18% over the
    # whole model, 5.5% at most on one LN bias.
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
def test_resume_from_full_checkpoint_under_bf16_equals_uninterrupted(runs, kind, world):
    got = load(runs, kind, world, "resume_bf16")
    assert_params_close(got["params"], got["uninterrupted"], 1e-6)


@pytest.mark.parametrize("world", WORLDS)
def test_backbone_finetuning_thaws_like_one_process(runs, world):
    """BackboneFinetuning freezes the backbone, then at epoch 1 unfreezes it and adds it to the optimizer as a
    new param group: same parameters as one plain process on the same global batches."""
    got, ref = load(runs, "mics", world, "finetune"), load(runs, "single", world, "finetune")
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
def test_failed_fit_then_second_fit_equals_ddp(runs, kind, world):
    got, ref = load(runs, kind, world, "fail_refit"), load(runs, "ddp", world, "fail_refit")
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
def test_a_parameter_only_some_ranks_use_equals_ddp(runs, kind, world):
    """Only the odd ranks' loss uses ``side``: the even ranks learn from the summed flags that it has a gradient,
    the odd ranks from their own; every rank must step it as DDP (find_unused_parameters) does."""
    got, ref = load(runs, kind, world, "some_ranks"), load(runs, "ddp", world, "some_ranks")
    assert got["side_moved"] > 0 and ref["side_moved"] > 0
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
@pytest.mark.parametrize("case", ["adamw_foreach", "adamw_fused"])
def test_foreach_and_fused_adamw_equal_ddp(runs, kind, world, case):
    """AdamW's foreach and fused implementations (the GPU default and litgpt's choice; CPU's default is neither)
    over the DTensor parameters, with accumulation and clipping by norm: the parameters DDP gets (measured: at
    most 2.5e-7 apart, as DDP's own fused and foreach runs are, 1.7e-7)."""
    got, ref = load(runs, kind, world, case), load(runs, "ddp", world, case)
    assert_params_close(got["params"], ref["params"], 1e-6)
    assert got["param_types"] == ["Parameter"]


@pytest.mark.parametrize("kind, world", MICS)
@pytest.mark.parametrize("case", ["user_checkpoint", "user_checkpoint_reentrant"])
def test_the_models_own_checkpointing_equals_ddp(runs, kind, world, case):
    """The model's forward calls ``torch.utils.checkpoint.checkpoint`` on each block (as HF's gradient
    checkpointing does), with accumulation and clipping: the replay inside backward gathers the block's unit
    again. Reentrant checkpointing is compared with DDP's non-reentrant run (the same gradients): DDP itself
    fails on it without ``static_graph`` ("marked as ready twice"). Measured: 1.3e-7 apart."""
    got, ref = load(runs, kind, world, case), load(runs, "ddp", world, "user_checkpoint")
    assert_params_close(got["params"], ref["params"], 1e-6)
    assert got["param_types"] == ["Parameter"]


@pytest.mark.parametrize("kind, world", MICS)
def test_torch_optimizers_equal_ddp(runs, kind, world):
    """torch.optim's other optimizers step the DTensor shards, in torch's CPU implementation and in the GPU's
    (foreach): the parameters DDP gets after 3 steps ([Note: optimizers over DTensors]; measured: bit for bit).
    Muon orthogonalizes each matrix's update in bfloat16, and under DTensor a matmul of sharded rows sums its
    partial products in another order: measured 6e-3 apart (with its Newton-Schulz in fp32, 3.6e-7), while
    stepping each rank's rows alone would give another update altogether."""
    got, ref = load(runs, kind, world, "torch_optim"), load(runs, "ddp", world, "torch_optim")
    assert sorted(got) == sorted(ref) and len(ref) >= 16, sorted(got)
    for label in ref:
        if label in ("params", "param_types", "initial"):
            continue
        assert_params_close(got[label], ref[label], 2e-2 if label == "Muon" else 1e-6)
    for name, want in ref["Muon"].items():  # within a fraction of what Muon moved each matrix (8.5e-2 at most
        moved = (ref["initial"][name] - want).norm()  # measured on 2 ranks): a matrix left unstepped is 1 away
        assert (got["Muon"][name] - want).norm() <= 0.3 * moved, (name, float(moved))


@pytest.mark.parametrize("kind, world", MICS)
def test_lbfgs_on_evenly_split_rows_equals_ddp(runs, kind, world):
    """LBFGS flattens every gradient, which DTensor does for rows that split evenly over the ranks that step them:
    with every parameter so, it runs, its closure (forward and backward, the gradient sync) up to 3 times a step.
    With the optimizer's rows over replicas (``mics_os``) they do not split evenly again: refused on every rank.
    LBFGS's line search and curvature pairs magnify rounding: on 4 ranks, where MiCS sums the gradients in another
    order (over 2, then over the 2 replicas), it is 2.6e-4 from DDP, and DDP itself 7.3e-4 from one process on the
    same batches (MiCS 5.3e-4); on 2 ranks, bit for bit."""
    got, ref = load(runs, kind, world, "lbfgs_even"), load(runs, "ddp", world, "lbfgs_even")
    if kind == "mics_os":  # the optimizer's rows over 2 replicas: each chunk's 19 rows are 10 and 9
        assert got["refused"].startswith("MiCSStrategy: LBFGS cannot step"), got["refused"]
        assert "_StridedShard" in got["refused"] and got["refused"].endswith("[after 0 steps]"), got["refused"]
        return
    assert "refused" not in got, got["refused"]
    assert_params_close(got["params"], ref["params"], 1e-6 if world == 2 else 2e-3)


@pytest.mark.parametrize("kind, world", MICS)
def test_optimizers_dtensor_cannot_step_are_refused_at_setup(runs, kind, world):
    """LBFGS on rows that do not split evenly (the embedding's 37 over 2), Rprop on either path, Adafactor on
    either path: a ValueError on every rank before the first step, naming the optimizer, what its step does, the
    parameter, and what is allowed, instead of DTensor's error inside the first step. A fit after them in the
    same processes trains: the refusals left the process group as it was."""
    got = load(runs, kind, world, "refused_optim")
    expect = {"LBFGS": ["LBFGS cannot step", "flattens each gradient", "(37, 24)", "not evenly divisible"],
              "Rprop": ["Rprop cannot step", "masks its step signs in place", "index_put_"],
              "Rprop_foreach": ["Rprop(foreach=True) cannot step", "torch._foreach_copy_", "_foreach_copy_.default"],
              "Adafactor": ["Adafactor cannot step", "squares a norm", "pow_"],
              "Adafactor_foreach": ["Adafactor(foreach=True) cannot step", "torch._foreach_mul_"]}
    for label, parts in expect.items():
        msg = got[label]
        assert msg.startswith("MiCSStrategy: ") and msg.endswith("[after 0 steps]"), (label, msg)
        for part in parts + ["Allowed: an optimizer DTensor can step", "param_persistence_threshold"]:
            assert part in msg, (label, part, msg)
    assert got["moved_after"] > 0 and got["param_types"] == ["Parameter"]  # a fit after them trained
    kept_whole = load(runs, kind, world, "rprop_kept_whole")  # what the message allows: Rprop on whole parameters
    assert_params_close(kept_whole["params"], load(runs, "ddp", world, "rprop_kept_whole")["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
def test_grad_norm_equals_lightnings_under_ddp(runs, kind, world):
    """``lightning_mics.grad_norm`` in ``on_before_optimizer_step`` (2 and inf, a frozen parameter, accumulation):
    every rank logs the norms Lightning's ``grad_norm`` gives under DDP (the unsharded gradients' norms), with the
    same keys; one all-reduce per mesh dimension the gradients are sliced over, not one per parameter (14)."""
    got, ref = load(runs, kind, world, "grad_norm"), load(runs, "ddp", world, "grad_norm")
    expected = ref["norms"][0]
    assert len(expected) == 6 and "grad_2.0_norm_total" in expected[0] and "grad_inf_norm_total" in expected[1]
    assert not any("blocks.0.ln" in k for k in expected[0]) and len(expected[0]) == 14  # frozen: no gradient
    for rank in range(world):
        assert ref["norms"][rank] == expected  # DDP: the same on every rank
        for a, b in zip(got["norms"][rank], expected):
            assert sorted(a) == sorted(b)
            assert max(abs(a[k] - b[k]) / b[k] for k in b) <= 1e-6, (rank, a, b)
    assert got["logged"] == ref["logged"]
    assert ref["collectives"] == [0] * 6
    assert got["collectives"] == [2 if kind == "mics_os" else 1] * 6, got["collectives"]


@pytest.mark.parametrize("kind, world", MICS)
def test_learning_rate_finder_equals_ddp(runs, kind, world):
    """``Tuner(trainer).lr_find``: it saves a checkpoint (a sharded directory here), runs 20 steps over growing
    learning rates, restores the checkpoint and removes it; then fit. The same suggestion as under DDP, set on
    the module, nothing left behind, and the parameters after fit equal DDP's."""
    got, ref = load(runs, kind, world, "lr_find"), load(runs, "ddp", world, "lr_find")
    assert got["suggestion"] == ref["suggestion"] == got["lr"], (got["suggestion"], ref["suggestion"])
    assert got["leftover"] == [], got["leftover"]
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
def test_learning_rate_finder_under_bf16_restores_the_fp32_masters(runs, kind, world):
    """The same under ``precision="bf16-mixed"``: after the finder the module holds its fp32 initial values bit
    for bit (a restore through bf16 would round them); fit after it equals the same fit without the finder; the
    finder's grid, its suggestion and the fit after it are DDP's, DDP running MiCS's precision policy
    (tests/helpers/bf16_policy.py; under autocast alone the suggestion could be a neighbour on the grid)."""
    got, ref = load(runs, kind, world, "lr_find_bf16"), load(runs, "ddp", world, "lr_find_bf16")
    assert got["restored"] == 0.0 and got["restored_dtypes"] == ["torch.float32"], got
    assert got["leftover"] == [] and got["suggestion"] == got["lr"], got
    assert got["candidates"] == ref["candidates"] and got["suggestion"] == ref["suggestion"], (got, ref)
    assert_params_close(got["params"], got["without_finder"], 1e-6)
    assert_params_close(got["params"], ref["params"], 1e-6)


@pytest.mark.parametrize("kind, world", MICS)
def test_a_module_left_sharded_after_fit_equals_ddp(runs, kind, world):
    """The module stays sharded (larger than max_live_parameters); with ``mics_os`` the first replica's rows of
    the last step are still on their way when its fit ends (the second replica steps late): they must land."""
    got, ref = load(runs, kind, world, "stays_sharded"), load(runs, "ddp", world, "stays_sharded")
    assert got["stayed_sharded"] and not ref["stayed_sharded"]
    assert_params_close(got["params"], ref["params"], 1e-6)
    for r, replica in enumerate(got["replicas"]):
        for name, p in got["params"].items():
            assert torch.equal(replica[name], p), (r, name)


@pytest.mark.parametrize("kind, world", MICS)
def test_a_module_left_sharded_after_fit_under_bf16_holds_fp32_masters_alike_on_every_replica(runs, kind, world):
    """The same under ``precision="bf16-mixed"``: the state dict holds the fp32 masters, bit for bit the same
    gathered by every rank's shard group (a replica that dropped the other's last rows differs), and within the
    masters of DDP running MiCS's precision policy (``test_bf16_mixed_returns_fp32_masters``)."""
    got, ref = load(runs, kind, world, "stays_sharded_bf16"), load(runs, "ddp", world, "stays_sharded_bf16")
    assert got["stayed_sharded"] and not ref["stayed_sharded"]
    for r, replica in enumerate(got["replicas"]):
        assert sorted(replica) == sorted(got["params"]), r
        for name, p in got["params"].items():
            assert p.dtype == torch.float32 and torch.equal(replica[name], p), (r, name)
    assert_params_close(got["params"], ref["params"], 1e-6)


def test_end_of_fit_and_saves_hold_no_more_than_one_unit(tmp_path):
    """A model larger than max_live_parameters stays sharded after fit (as FSDP2 leaves its module). Measured
    from the allocator (the profiler's memory events: every allocation and free), not the engine's counters:
    the end of fit allocates nothing beyond one unit on any rank; a full state dict and a full checkpoint
    allocate at most one unit on every rank except rank 0, which receives the full state it asked for."""
    res = run_ranks(REPO / "tests" / "trainer" / "end_of_fit_memory.py", 4, ["--max-live", "100000"], tmp_path)
    for r in res:
        unit = r["unit_bytes"]
        assert r["stays_sharded"], r
        assert r["end_of_fit"] <= unit, r
        if r["rank"] == 0:
            assert r["state_dict_keys"] == r["model_keys"]
            assert r["state_dict"] <= r["param_bytes"] + unit, r
        else:
            assert r["state_dict"] <= unit and r["save_checkpoint"] <= unit, r
