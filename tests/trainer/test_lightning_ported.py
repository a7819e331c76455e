"""Lightning's own sharded-strategy tests with MiCSStrategy in FSDP's / ModelParallel's place, and users' flows.

Ported from Lightning 2.6's ``tests/tests_pytorch/strategies/test_fsdp.py``, ``test_model_parallel_integration.py``
and the multi-device cases of ``trainer/optimization/test_manual_optimization.py`` to CPU with 2 ranks, keeping their
assertions (they run inside the ranks: ``tests/trainer/lightning_ported.py`` and ``lightning_flows.py``). One launch
per (script, strategy) runs all its cases; each test reads its case's errors and results. Where the flow allows a
control, the results are compared with Lightning's DDP on the same seed and data: predictions, test losses,
parameters, optimizer state.
"""

import pytest
import torch

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPTS = {"ported": REPO / "tests" / "trainer" / "lightning_ported.py",
           "flows": REPO / "tests" / "trainer" / "lightning_flows.py"}
PRECISIONS = ["32-true", "bf16-mixed"]
SEQUENCES = ["fit-test-save", "fit-validate-test-predict-save-fit", "test-fit-save", "predict-validate-fit-test-fit",
             "fit-save-test-save-fit"]
FLOWS = (["manual_return_tensor", "manual_frequencies", "manual_toggle", "inference_inference_mode",
          "inference_no_grad"] + [f"seq_{size}_{ops}" for size in ("small", "large") for ops in SEQUENCES])
PORTED_DDP = [f"stages_sharded_{p}" for p in PRECISIONS] + ["multi_manual", "multi_linear"]


def _case_names():
    thresholds = (0, 1024, 100_000_000)
    return ([f"stages_{t}_{p}" for t in ("sharded", "full") for p in PRECISIONS] + ["multi_manual", "multi_linear"]
            + [f"{k}_{n}" for k in ("full_sd", "save_opt", "load_opt") for n in thresholds]
            + ["save_opt_ff", "load_opt_ff", "configure_model", "init_32-true", "init_16-true", "init_bf16-true",
               "sharded_sd_boring", "sharded_sd_ff", "consolidate", "no_params", "save_over", "checkpoint_io",
               "size_mismatch"])


LAUNCHES = {("ported", "mics"): _case_names(), ("ported", "ddp"): PORTED_DDP,
            ("flows", "mics"): FLOWS, ("flows", "ddp"): FLOWS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(script, strategy): (folder, per-rank results)}; each launched once for the module."""
    out = {}

    def get(script, kind):
        if (script, kind) not in out:
            d = tmp_path_factory.mktemp(f"{script}_{kind}")
            res = run_ranks(SCRIPTS[script], 2, ["--strategy", kind, "--cases", ",".join(LAUNCHES[script, kind])], d,
                            timeout=900)
            out[script, kind] = (d, res)
        return out[script, kind]
    return get


def case(runs, script, kind, name):
    """The case's rank-0 result and every rank's facts; fails with the case's traceback if any rank raised."""
    d, res = runs(script, kind)
    for rank, r in enumerate(res):
        assert name not in r["errors"], f"{kind}, case {name}, rank {rank}:\n{r['errors'][name]}"
    return torch.load(d / f"{name}.pt", weights_only=False), [r["facts"][name] for r in res]


def assert_close(got, want, tol=1e-6):
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for k in want:
            assert_close(got[k], want[k], tol)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_close(g, w, tol)
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    else:
        assert got == want or (isinstance(want, float) and abs(got - want) <= tol * max(1.0, abs(want))), (got, want)


# -- test_fsdp.py / test_model_parallel_integration.py --------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_strategy_checkpoint(runs, state_dict_type, precision):
    """fit -> test -> save (with and without optimizer state) -> test/predict under inference_mode, from the module
    and from the checkpoint (users' flows: fit-test-save and predict); the predictions, and the parameters and
    optimizer state after resuming from the checkpoint saved after test, equal DDP's."""
    got, _ = case(runs, "ported", "mics", f"stages_{state_dict_type}_{precision}")
    want, _ = case(runs, "ported", "ddp", f"stages_sharded_{precision}")
    # bf16-mixed: DDP runs MiCS's precision policy (Bf16Copies); on this model of Linear layers autocast alone casts
    # the same weights, and both controls end where MiCS does bit for bit
    assert_close(got["predict"], want["predict"])
    assert_close(got["predict_ckpt"], want["predict_ckpt"])
    assert_close(got["resumed_params"], want["resumed_params"])
    assert_close(got["resumed_opt"]["param_groups"], want["resumed_opt"]["param_groups"])
    assert_close(got["resumed_opt"]["state"], want["resumed_opt"]["state"], 1e-5)


@pytest.mark.parametrize("variant", ["manual", "linear"])
def test_checkpoint_multi_gpus(runs, variant):
    got, _ = case(runs, "ported", "mics", f"multi_{variant}")
    want, _ = case(runs, "ported", "ddp", f"multi_{variant}")
    assert_close(got, want)


@pytest.mark.parametrize("threshold", [0, 1024, 100_000_000])
def test_strategy_full_state_dict(runs, threshold):
    """Full on rank 0 with the unwrapped module's keys in order, {} on rank 1 (a user's state dict after fit)."""
    got, facts = case(runs, "ported", "mics", f"full_sd_{threshold}")
    assert facts[0]["len"] == 4 and facts[1]["len"] == 0


@pytest.mark.parametrize("name", ["save_opt_0", "save_opt_1024", "save_opt_100000000", "save_opt_ff"])
def test_strategy_save_optimizer_states(runs, name):
    """A full MiCS checkpoint restores into DDP with the same model and optimizer state (exactly); the state dict
    and the optimizer state are {} off rank 0."""
    _, facts = case(runs, "ported", "mics", name)
    assert facts[0]["sd"] > 0 and facts[0]["opt"] > 0
    assert facts[1] == {"sd": 0, "opt": 0}


@pytest.mark.parametrize("name", ["load_opt_0", "load_opt_1024", "load_opt_100000000", "load_opt_ff"])
def test_strategy_load_optimizer_states(runs, name):
    _, facts = case(runs, "ported", "mics", name)
    assert facts[0]["sd"] > 0 and facts[0]["opt"] > 0
    assert facts[1] == {"sd": 0, "opt": 0}


@pytest.mark.parametrize("name", ["configure_model", "init_32-true", "init_16-true", "init_bf16-true",
                                  "sharded_sd_boring", "sharded_sd_ff", "consolidate", "no_params", "save_over",
                                  "checkpoint_io", "size_mismatch"])
def test_ported_case(runs, name):
    """configure_model, module_init_context (3 precisions, with and without empty_init), save/load of a sharded
    state dict (two models), save sharded -> consolidate -> DDP resumes, modules without parameters, saves over an
    existing path (a directory holding other files refused on every rank), a CheckpointIO plugin (acts with full
    checkpoints, AsyncCheckpointIO included; refused with sharded ones), a resume into other shapes (refused,
    naming each entry)."""
    case(runs, "ported", "mics", name)


# -- test_manual_optimization.py (multi-device cases) ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["manual_return_tensor", "manual_frequencies", "manual_toggle"])
def test_manual_optimization_equals_ddp(runs, name):
    got, _ = case(runs, "flows", "mics", name)
    want, _ = case(runs, "flows", "ddp", name)
    assert_close(got["params"], want["params"], 1e-5)


# -- users' flows -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctx", ["inference_mode", "no_grad"])
def test_test_and_predict_under_inference_equal_ddp(runs, ctx):
    """test/predict inside the user's ``inference_mode``/``no_grad`` before and after fit give DDP's outputs, and a
    second fit after them trains like DDP's."""
    got, _ = case(runs, "flows", "mics", f"inference_{ctx}")
    want, _ = case(runs, "flows", "ddp", f"inference_{ctx}")
    assert_close(got, want)


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("ops", SEQUENCES)
def test_entry_point_sequences_equal_ddp(runs, size, ops):
    """Any order of fit/validate/test/predict/save_checkpoint on one Trainer: the optimizers never hold a parameter
    the module does not have (checked in the ranks after every entry point), and the final parameters and the saved
    model and optimizer state equal DDP's. ``small`` is made plain after each entry point, ``large`` stays sharded."""
    got, _ = case(runs, "flows", "mics", f"seq_{size}_{ops}")
    want, _ = case(runs, "flows", "ddp", f"seq_{size}_{ops}")
    assert_close(got["params"], want["params"])
    assert_close(got["state_dict"], want["state_dict"])
    assert_close(got["optimizer"], want["optimizer"], 1e-5)
