"""litgpt's ``GPT`` in litgpt's pretraining loop pattern (``examples/fabric_litgpt/pretrain.py``: meta init with
litgpt's ``initialize_weights``, ``fabric.setup`` + ``setup_optimizers``, ``no_backward_sync`` while
accumulating, ``clip_gradients``, AdamW; also fused AdamW and the model ``torch.compile``d, as litgpt runs it,
and compiled with the Blocks activation-checkpointed), and litgpt's LoRA finetuning pattern, under
``lightning_mics.fabric.MiCSStrategy`` on 4 CPU ranks, against one plain process on the same global batches.
litgpt comes with the ``[dev]`` extra (without transformers)."""

import pytest

from tests.helpers.launch import REPO, run_ranks

import litgpt.model  # noqa: F401  a test dependency ([dev] extra): missing, this module fails, it is not skipped
SCRIPT = REPO / "tests" / "scripts" / "fabric_litgpt.py"
LORA = REPO / "tests" / "scripts" / "litgpt_lora.py"
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


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_litgpt_lora_finetune_loop_equals_one_plain_process(tmp_path, fmt):
    """litgpt's LoRA finetuning pattern (tests/scripts/litgpt_lora.py: meta init, only the LoRA matrices trainable,
    the base weights from a plain GPT's file through ``fabric.load_raw(strict=False)``, its Blocks checkpointed,
    the LoRA weights saved with ``filter={"model": lora_filter}``) on 4 ranks, s = 2. The base weights land where
    litgpt's own ``_load_from_state_dict`` maps them (``lm_head.weight`` -> ``lm_head.linear.weight``), exactly;
    the frozen ones never move; the LoRA matrices train as one plain process does; the file holds them alone."""
    r = run_ranks(LORA, 4, ["--world", "4", "--s", "2", "--format", fmt], tmp_path)[0]
    assert r["pretrained_loaded"] == 0.0 and r["frozen_moved"] == 0.0, r
    assert r["lora_moved"] > 1e-3 and r["lora_rel"] <= 1e-4, r  # measured: 1.3e-6 at most (AdamW)
    assert r["n_lora"] == 16 and r["saved"] == r["lora_names"], r
