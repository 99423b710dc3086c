"""The conformance matrix on the qwen2 family (tests/conformance.py): each capability's curve on 1 and 2 ranks and two
micro-batch sizes within the bound docs/invariance.md states for it."""

from __future__ import annotations

import pytest
from conformance import capabilities, check, run_family

pytestmark = pytest.mark.slow
FAMILY = "qwen2"


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    return run_family(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.parametrize("cap", capabilities(FAMILY), ids=lambda cap: cap.name)
def test_capability_keeps_its_curve(curves, cap) -> None:
    check(curves, FAMILY, cap)
