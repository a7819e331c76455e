"""litgpt's ``GPT`` in litgpt's pretraining loop pattern (``examples/fabric_litgpt/pretrain.py``: meta init with
litgpt's ``initialize_weights``, ``fabric.setup`` + ``setup_optimizers``, ``no_backward_sync`` while
accumulating, ``clip_gradients``, AdamW; also fused AdamW and the model ``torch.compile``d, as litgpt runs it,
and compiled with the Blocks activation-checkpointed), and litgpt's LoRA finetuning pattern, under
``lightning_mics.fabric.MiCSStrategy`` on 4 CPU ranks, against one plain process on the same global batches.
litgpt comes with the ``[dev]`` extra (without transformers)."""

import pytest

from tests.helpers.launch import REPO, run_ranks

import litgpt.model  # noqa: F401  a test dependency ([dev] extra): missing, this module fails, it is not skipped
SCRIPT = REPO / "tests" / "fabric" / "fabric_litgpt.py"
LORA = REPO / "tests" / "fabric" / "litgpt_lora.py"
pytestmark = pytest.mark.distributed


def test_litgpt_pretrain_loop_equals_one_plain_process(tmp_path):
    # s, accumulation[, fused AdamW and torch.compile, as litgpt runs][, activation checkpointing of the Blocks]
    cases = ["2:4", "4:2", "2:2:fused:compile", "2:2:compile:ac"]
    results = run_ranks(SCRIPT, 4, ["--world", "4", "--cases", *cases], tmp_path)
    for case in cases:
        r = results[0][case]
        assert r["steps"] == 3 and r["moved"] == r["n"], r
        # AdamW, globally (the attention key bias has a zero gradient up to rounding, which AdamW turns into
        # lr-sized steps: that one tensor differs in both runs alike from any other summation order)
        assert r["rel_global"] <= 1e-4, r
        assert all(x[case]["units"] == 3 for x in results)  # the root and litgpt's two Blocks (shard_units)


PRECISIONS = {"sharded": ["32-true", "bf16-true", "bf16-mixed"], "full": ["32-true"]}


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_litgpt_lora_finetune_loop_equals_one_plain_process(tmp_path, fmt):
    """litgpt's LoRA finetuning pattern (tests/fabric/litgpt_lora.py: meta init, only the LoRA matrices trainable,
    the base weights from a plain GPT's fp32 file through ``fabric.load_raw(strict=False)``, its Blocks
    checkpointed, the LoRA weights saved with ``filter={"model": lora_filter}``) on 4 ranks, s = 2, in fp32 and
    (sharded) in litgpt's two bf16 precisions. The base weights land where litgpt's own ``_load_from_state_dict``
    maps them (``lm_head.weight`` -> ``lm_head.linear.weight``) and as one plain process's ``load_state_dict``
    rounds them into bf16, exactly; the frozen ones never move; the LoRA matrices train as one plain process
    does in the same precision (in bf16: bit for bit as one that computes what the precision prescribes for
    MiCS); the file holds them alone, in the precision's parameter dtype, equal to the module's."""
    results = run_ranks(LORA, 4, ["--world", "4", "--s", "2", "--format", fmt, "--precisions", *PRECISIONS[fmt]],
                        tmp_path)[0]
    assert sorted(results) == sorted(PRECISIONS[fmt]), results
    for precision, r in results.items():
        assert r["pretrained_loaded"] == 0.0 and r["frozen_moved"] == 0.0, (precision, r)
        assert r["n_lora"] == 16 and r["saved"] == r["lora_names"] and r["saved_equal"] == 0.0, (precision, r)
        stored = "torch.bfloat16" if precision == "bf16-true" else "torch.float32"  # bf16-mixed: fp32 masters
        assert r["dtypes"] == r["saved_dtypes"] == [stored], (precision, r)
        assert r["lora_moved"] > 1e-3, (precision, r)
        if precision == "32-true":
            assert r["lora_rel"] <= 1e-4 and r["emulated_rel"] <= 1e-4, r  # measured: 1.7e-6 at most (AdamW)
        else:
            # Against what the precision says MiCS computes (the plain process with each rank's micro-batch on
            # bf16 copies of the parameters, the gradients summed in fp32): measured 0.0, bit for bit; only the
            # order of the fp32 sums may differ, which a bf16 gradient rarely sees (bound: a few elements one
            # bf16 unit apart). Against the plain process's own roundings (whole batch, bf16 gradients summed in
            # bf16 for bf16-true; autocast on fp32 weights for bf16-mixed): measured 6.1e-3 and 2.3e-2, which
            # AdamW spreads over every entry whose gradient is near zero.
            assert r["emulated_rel_global"] <= 1e-3, (precision, r)
            assert r["lora_rel_global"] <= 5e-2, (precision, r)
