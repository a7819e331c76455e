"""``torch.compile`` under MiCS (the engine's module hooks run outside the compiled graphs: [Note: hooks under
torch.compile] in hooks.py): the whole model compiled before ``fabric.setup``, as litgpt's pretraining does, and
a compiled submodule under the Trainer. Each against DDP compiled the same way, on 2 CPU ranks (s = 2)."""

import pytest
import torch

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "scripts" / "compiled.py"


def rel(a, b):
    return (a.float() - b.float()).norm().item() / max(b.float().norm().item(), 1e-12)


@pytest.mark.parametrize("front", ["fabric", "trainer"])
def test_compiled_model_equals_compiled_ddp(tmp_path, front):
    out = {}
    for kind in ("mics", "ddp"):
        d = tmp_path / kind
        d.mkdir()
        run_ranks(SCRIPT, 2, ["--front", front, "--strategy", kind], d)
        out[kind] = torch.load(d / "compiled.pt", weights_only=False)
    got, ref = out["mics"], out["ddp"]
    assert sorted(got["params"]) == sorted(ref["params"])
    for name, want in ref["params"].items():
        assert rel(got["params"][name], want) <= 1e-6, (name, rel(got["params"][name], want))
    # it was compiled (graphs exist), and nothing recompiled after the first optimizer step
    assert got["graphs_first_step"] >= 1 and got["graphs_end"] == got["graphs_first_step"], got
