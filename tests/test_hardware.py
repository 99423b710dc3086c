"""Hardware facts: vendor, backend, TF32 switch, MFU arithmetic."""

import pytest
import torch

from anygpu.config.args import ModelArguments
from anygpu.model.modeling import resolve_config
from anygpu.runtime import hardware
from anygpu.runtime.distributed import backend_for
from anygpu.train import metrics


def test_cpu_machine_is_cpu_with_gloo():
    if torch.cuda.is_available():
        pytest.skip("GPU present")
    assert hardware.vendor() == "cpu" and hardware.devices() == []
    assert backend_for(torch.device("cpu")) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"
    assert hardware.configure_tf32(None) is False  # nothing to switch on a CPU


def test_tf32_flag_follows_the_request_on_the_torch_api_in_use():
    hardware.configure_tf32(False)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    else:
        assert torch.backends.cuda.matmul.allow_tf32 is False


def test_deterministic_algorithms_only_where_verify_asks(monkeypatch):
    """ANYGPU_DETERMINISTIC=1 (anygpu verify's runs) switches torch's deterministic algorithms on, warning
    instead of failing on an op without a deterministic kernel; unset, nothing changes."""
    monkeypatch.delenv(hardware.DETERMINISTIC_ENV, raising=False)
    assert hardware.configure_determinism() is False and not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv(hardware.DETERMINISTIC_ENV, "1")
    try:
        assert hardware.configure_determinism() is True
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.utils.deterministic.fill_uninitialized_memory = True


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("AMD Instinct MI300X", 1307),
        ("NVIDIA H100 PCIe", 756),
    ],
)
def test_peak_table(name, tflops):
    assert hardware.peak_bf16_flops(name) == tflops * 1e12


def test_unknown_part_warns_and_has_no_mfu(caplog):
    assert hardware.peak_bf16_flops("Some Future GPU") is None
    assert "unknown" in caplog.text
    assert metrics.mfu(1e5, 1e9, None, 8) is None


def test_mfu_of_the_1b_preset():
    cfg = resolve_config(ModelArguments(config_name="llama-1b"))
    n = 1_235_814_400  # Llama-3.2-1B: the tied embedding counted once, as the output projection's matmul
    fpt = metrics.flops_per_token(cfg, n, 2048)
    assert fpt == 6 * n + 12 * 16 * 2048 * 2048
    # 8 H100s at 40% MFU process this many tokens per second
    tps = 0.4 * 989e12 * 8 / fpt
    assert metrics.mfu(tps, fpt, 989e12, 8) == pytest.approx(0.4)
