"""Batch math: G = per-device × world × accumulation, always, or a refusal that says why."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anygpu.config.batch import plan_batch, resolve_global_batch
from anygpu.errors import UsageError

sizes = st.integers(min_value=1, max_value=512)
worlds = st.integers(min_value=1, max_value=64)


@given(G=sizes, W=worlds)
def test_derived_plan_keeps_the_global_batch(G, W):
    if G % W:
        with pytest.raises(ValueError, match="--global_batch_size"):
            plan_batch(G, W)
        return
    p = plan_batch(G, W)
    assert p.per_device_train_batch_size * W * p.gradient_accumulation_steps == G
    assert 1 <= p.per_device_train_batch_size <= 8
    # the largest micro-batch that fits: no bigger divisor ≤ 8 was skipped
    assert all((G // W) % d for d in range(p.per_device_train_batch_size + 1, 9))


@given(G=sizes, W=worlds, m=st.integers(1, 64))
def test_given_per_device_batch_is_kept_or_refused(G, W, m):
    ok = G % W == 0 and (G // W) % m == 0
    if not ok:
        with pytest.raises(ValueError, match="--global_batch_size|--per_device_train_batch_size"):
            plan_batch(G, W, per_device_train_batch_size=m)
        return
    p = plan_batch(G, W, per_device_train_batch_size=m)
    assert (p.per_device_train_batch_size, p.gradient_accumulation_steps) == (m, G // (m * W))


@given(G=sizes, W=worlds, m=st.integers(1, 16), A=st.integers(1, 16))
def test_all_three_given_must_agree(G, W, m, A):
    if G % W == 0 and m * A * W == G:
        assert plan_batch(G, W, m, A).gradient_accumulation_steps == A
    else:
        with pytest.raises(ValueError):
            plan_batch(G, W, m, A)


@settings(max_examples=50)
@given(tokens=st.integers(1, 100_000), block=st.integers(2, 4096))
def test_global_batch_in_tokens(tokens, block):
    if tokens % block:
        with pytest.raises(ValueError, match="--global_batch_tokens .* multiple of --block_size"):
            resolve_global_batch(None, tokens, block, None, None, 1)
    else:
        assert resolve_global_batch(None, tokens, block, None, None, 1) == tokens // block


def test_tokens_and_sequences_together_are_refused():
    with pytest.raises(ValueError, match="--global_batch_size 8 and --global_batch_tokens 512 both"):
        resolve_global_batch(8, 512, 64, None, None, 1)


def test_banner_line():
    assert (
        plan_batch(64, 8, per_device_train_batch_size=1).banner()
        == "global batch 64 = 1 per device × 8 devices × 8 accumulation steps"
    )
    assert plan_batch(8, 1).banner() == "global batch 8 = 8 per device × 1 device × 1 accumulation step"


def test_indivisible_world_size_names_valid_choices():
    with pytest.raises(ValueError) as e:
        plan_batch(10, 4)
    assert "--global_batch_size 10" in str(e.value) and "multiple of 4" in str(e.value) and "12" in str(e.value)


def test_grpo_groups_and_world_size_name_a_value_that_fits_both():
    """8 completions in groups of 4 on 3 devices: the value named fits the devices and the groups (12), not the
    devices alone (6 or 9, which the groups then refuse)."""
    with pytest.raises(ValueError) as e:
        plan_batch(8, 3, groups=4)
    assert "in whole groups of --num_generations 4: use a multiple of 12 (e.g. 12)" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="use a multiple of 12"):
        plan_batch(6, 3, groups=4)  # splits over the devices, not into whole groups
    assert plan_batch(12, 3, groups=4).per_device_train_batch_size == 4


@pytest.mark.parametrize(
    "epochs, per_epoch, steps",
    [(0.5, 397, 199), (2.5, 397, 993), (0.01, 397, 4), (0.29, 100, 29), (1.15, 100, 115), (0.3, 10, 3), (1, 397, 397)],
)
def test_epochs_count_steps_as_trainer_rounds_them(epochs, per_epoch, steps):
    """--num_train_epochs rounds up as Trainer's max_steps does (it was rounded down: 0.5 epochs of 397 steps gave
    198, 0.29 of 100 gave 28 from 28.999999999999996); a product that is whole up to float rounding stays whole."""
    import math

    from anygpu.data.order import steps_for_epochs

    assert steps_for_epochs(epochs, per_epoch) == steps
    if (epochs * per_epoch) % 1 > 1e-6:  # where the product is not whole, Trainer's own count
        assert steps == math.ceil(epochs * per_epoch)


def test_only_accumulation_steps_given_counts_trainers_per_device_default():
    """--gradient_accumulation_steps alone: G follows as in Trainer, whose per-device batch defaults to 8 (it was
    counted as 1: a global batch 8 times smaller than the Trainer run the user moved from)."""
    assert resolve_global_batch(None, None, 64, None, 2, 1) == 16
    assert resolve_global_batch(None, None, 64, None, 4, 2) == 64
    assert resolve_global_batch(None, None, 64, 3, None, 2) == 6  # the per-device batch given: as given


def test_one_device_is_not_each_of_1_devices():
    with pytest.raises(
        UsageError, match="does not divide the 10 sequences the device gets from --global_batch_size 10"
    ):
        plan_batch(10, 1, 3, None)
    with pytest.raises(UsageError, match="the 5 sequences each of 2 devices gets"):
        plan_batch(10, 2, 3, None)
