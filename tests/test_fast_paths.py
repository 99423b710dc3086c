"""The fast paths change no result: one process trains unsharded with FSDP2's losses, checkpoints
cross between plain tensors (1 rank) and DTensors (2 ranks), resume stays exact with the background
prefetch and with asynchronous saves, and a run killed mid-save resumes from the previous checkpoint."""
import json

import pytest

from conftest import TINY, assert_close, losses, python, torchrun

pytestmark = pytest.mark.slow
SCRIPT = "run_fsdp_standalone.py"
TEN = [*TINY, "--max_steps", "10", "--export_final", "false"]


def test_one_rank_unsharded_has_fsdp2_losses(tmp_path):
    # 4 micro-batches of 2 per step: accumulation without FSDP's gradient-sync switch
    proc = python("tests/scripts/one_rank_paths.py", [*TINY, "--max_steps", "6", "--per_device_train_batch_size", "2",
                                                     "--output_dir", str(tmp_path)])
    got = json.loads(proc.stdout.split("LOSSES ", 1)[1].splitlines()[0])
    assert len(got["plain"]) == 6 and got["plain"][-1] < got["plain"][0]
    for a, b in zip(got["plain"], got["fsdp"]):
        assert abs(a - b) <= 1e-6 * abs(b), got


@pytest.fixture(scope="module")
def crossed(tmp_path_factory) -> dict[str, dict[int, float]]:
    """Steps 1-5 on 1 rank (plain tensors) resumed on 2 (DTensors), and the other way round."""
    out = {}
    for first, second in ((1, 2), (2, 1)):
        d = tmp_path_factory.mktemp(f"cross{first}{second}")
        torchrun(first, SCRIPT, [*TEN, "--output_dir", str(d), "--stop_at_step", "5"])
        proc = torchrun(second, SCRIPT, [*TEN, "--output_dir", str(d), "--resume_from_checkpoint", "latest"])
        assert f"was {first} ranks, now {second}" in proc.stdout
        out[f"{first}to{second}"] = losses(d)
    return out


def test_checkpoints_cross_between_one_and_two_ranks(crossed):
    a, b = crossed["1to2"], crossed["2to1"]
    assert sorted(a) == sorted(b) == list(range(1, 11))
    # the first halves ran on different world sizes, the second halves resumed across them: one curve
    assert_close(a, b, rel=1e-5)
