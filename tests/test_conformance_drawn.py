"""The conformance matrix on a family no test names (tests/conformance.py's draw_family): a config drawn from a
seed, trained with the capabilities every dense family must take. The seed is fixed, so CI draws the same family
each run (a failure is never a new draw); ANYGPU_CONFORMANCE_SEED=N draws another, and a failure names its seed
and config."""

from __future__ import annotations

import os

import pytest
from conformance import FAMILIES, draw_family, family_tests

pytestmark = pytest.mark.slow
SEED = int(os.environ.get("ANYGPU_CONFORMANCE_SEED", "0"))  # a Mistral: sliding window, bf16, CP
FAMILY = f"drawn-{SEED}"
FAMILIES[FAMILY] = draw_family(SEED)


curves, test_capability_keeps_its_curve = family_tests(FAMILY)
