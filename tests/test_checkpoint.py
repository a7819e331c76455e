"""A full checkpoint written under one layout resumes under another and continues exactly."""

import pytest

from tests.helpers.launch import REPO, run_ranks

pytestmark = pytest.mark.distributed
SCRIPT = REPO / "tests" / "scripts" / "resume.py"


def test_save_resume_reshard(tmp_path):
    run_ranks(SCRIPT, 4, ["--phase", "a", "--s", "2"], tmp_path)
    res = run_ranks(SCRIPT, 4, ["--phase", "b", "--s", "4"], tmp_path)
    assert all(r["step"] == 4 for r in res)
    assert res[0]["ckpt_keys_ok"] and res[0]["ckpt_opt_momentum"]
    assert res[0]["max_abs"] < 1e-6, res[0]
