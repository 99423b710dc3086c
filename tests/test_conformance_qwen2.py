"""The conformance matrix on the qwen2 family (tests/conformance.py): each capability's curve on 1 and 2 ranks and two
micro-batch sizes within the bound docs/invariance.md states for it."""

import pytest
from conformance import family_tests

pytestmark = pytest.mark.slow
curves, test_capability_keeps_its_curve = family_tests("qwen2")
