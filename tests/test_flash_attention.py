"""Flash attention: refused up front where it cannot run, and given packed rows it recognises as packed."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import TINY

from anygpu.engines.fsdp import main as fsdp_main
from anygpu.engines.hf.engine import main as hf_main

ENGINES = {"fsdp": fsdp_main, "hf": hf_main}


def refused(main, argv: list[str], capsys) -> str:
    """The one-line refusal (exit 2), before any process group exists."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not dist.is_initialized()
    return err


@pytest.mark.parametrize("engine", ["fsdp", "hf"])
@pytest.mark.parametrize("version", ["2", "3"])
def test_flash_attention_in_fp32_is_refused_naming_the_precision(engine, version, capsys, tmp_path):
    err = refused(
        ENGINES[engine],
        [*TINY, "--attn_implementation", f"flash_attention_{version}", "--output_dir", str(tmp_path)],
        capsys,
    )
    assert f"--attn_implementation flash_attention_{version}" in err and "--bf16" in err and "sdpa" in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("engine", ["fsdp", "hf"])
def test_flash_attention_without_the_package_is_refused_naming_the_fix(engine, capsys, tmp_path):
    """Here (CPU, no flash-attn): one line naming the package to install or sdpa, not a traceback from a rank."""
    argv = [*TINY, "--attn_implementation", "flash_attention_2", "--bf16", "true", "--output_dir", str(tmp_path)]
    err = refused(ENGINES[engine], argv, capsys)
    assert "--attn_implementation flash_attention_2" in err and "flash-attn" in err and "sdpa" in err, err
