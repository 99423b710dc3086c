"""TF32: torch's legacy and new switches agree (torch 2.9-2.10 raise when a reader of one finds the other set
differently; inductor and Trainer read the legacy one), and on ROCm TF32 is on only where hipBLASLt will use it:
the banner and the MFU peak follow what the hardware does."""

from __future__ import annotations

import types

import pytest
import torch

from anygpu.runtime import hardware


@pytest.fixture(autouse=True)
def restore_flags():
    yield
    hardware.configure_tf32(False)


def legacy_and_new() -> tuple:
    """Every reading of the switch; reading the legacy ones raises when the two APIs disagree."""
    b = torch.backends
    return (
        b.cuda.matmul.allow_tf32,
        b.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        b.cuda.matmul.fp32_precision,
        b.cudnn.conv.fp32_precision,
    )


def on_gpu(monkeypatch, vendor: str, arch: str = "gfx942:sramecc+:xnack-") -> None:
    monkeypatch.setattr(hardware, "vendor", lambda: vendor)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(gcnArchName=arch))


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9: one API")
def test_legacy_and_new_switches_agree(monkeypatch):
    on_gpu(monkeypatch, "nvidia")
    assert hardware.configure_tf32(True) is True
    assert legacy_and_new() == (True, True, "high", "tf32", "tf32")
    assert hardware.configure_tf32(False) is False
    assert legacy_and_new() == (False, False, "highest", "ieee", "ieee")


def test_rocm_tf32_is_on_through_hipblaslt(monkeypatch):
    """MI300-class (gfx942): TF32 (XF32) needs HIPBLASLT_ALLOW_TF32=1, set when the caller left it unset."""
    on_gpu(monkeypatch, "amd")
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
    assert hardware.configure_tf32(None) is True
    import os

    assert os.environ["HIPBLASLT_ALLOW_TF32"] == "1"


def test_rocm_tf32_is_off_where_hipblaslt_will_not_use_it(monkeypatch):
    on_gpu(monkeypatch, "amd")
    monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "0")  # the caller's choice: fp32 matmuls stay IEEE
    assert hardware.configure_tf32(None) is False
    on_gpu(monkeypatch, "amd", arch="gfx90a:sramecc+:xnack-")  # MI250X: no XF32 at all
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32")
    assert hardware.configure_tf32(True) is False
