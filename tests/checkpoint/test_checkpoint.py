"""A checkpoint (full and sharded) written under one layout resumes under another and continues exactly."""

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "checkpoint" / "resume.py"


def test_save_resume_reshard(tmp_path):
    run_ranks(SCRIPT, 4, ["--phase", "a", "--s", "2"], tmp_path)
    res = run_ranks(SCRIPT, 4, ["--phase", "b", "--s", "4"], tmp_path)
    for kind in ("full", "sharded"):
        assert all(r[kind]["step"] == 4 for r in res), kind
        assert res[0][kind]["ckpt_keys_ok"] and res[0][kind]["ckpt_opt_momentum"], kind
        assert res[0][kind]["max_abs"] < 1e-6, (kind, res[0][kind])
