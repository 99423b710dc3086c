"""The package as `pip install anygpu` gives it: a wheel built from this repository, installed into a fresh
virtual environment that sees the test environment's dependencies but neither the repository nor its editable
install, trains the tiny preset with `anygpu launch` from an empty folder, with either engine (real torchrun and
`accelerate launch`, two CPU processes each). And the engines' entry modules, which the launcher runs, under
`torchrun -m`, `accelerate launch -m` and `python -m` alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, accelerate_launch, env, python, records, torchrun

pytestmark = pytest.mark.slow  # a wheel build and a venv, then real launches

SOURCES = ("pyproject.toml", "README.md", "requirements.txt", "anygpu")  # what the wheel is built from


def sh(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def build_wheel(tmp: Path) -> Path:
    """`pip wheel` of a copy of the sources (an in-tree build would leave build/ in the repository)."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    dist = tmp / "dist"
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("anygpu-*.whl")
    return wheel


def dependency_dirs() -> list[str]:
    """The test environment's site-packages folders (torch, transformers, …). Added to the fresh venv as a .pth
    file's lines, whose own .pth files are not read: the editable install's finder stays out."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed, then the test environment's dependencies."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    venv = tmp / "venv"
    sh([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    # pip of the test environment installs into the venv (--python); the dependencies are added after, so pip sees
    # an empty environment (no anygpu already installed) and the wheel's anygpu comes first on the path.
    sh([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    site = sh([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    (Path(site) / "test_dependencies.pth").write_text("\n".join(dependency_dirs()) + "\n")
    return venv


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def venv_env(venv: Path) -> dict[str, str]:
    e = {k: v for k, v in env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**e, "PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"}  # no GPU tool, no test venv


def test_the_installed_package_is_the_wheel_not_the_repository(venv, tmp_path):
    code = (
        "import importlib.util as u, anygpu.engines.run_fsdp as e, anygpu.launch.launcher as l; "
        "print(e.__file__); print(l.CONFIG_DIR); print(u.find_spec('run_fsdp_standalone'))"
    )
    out = sh([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=venv_env(venv)).stdout.split()
    site = site_packages(venv)
    assert out[0] == str(site / "anygpu" / "engines" / "run_fsdp.py")
    assert sorted(p.name for p in Path(out[1]).glob("*.yaml")) == sorted(
        p.name for p in ROOT.glob("accelerate_configs/*.yaml")
    )
    assert Path(out[1]).is_relative_to(site) and out[2] == "None"  # no repository script on the path


@pytest.mark.parametrize("engine, nproc", [("fsdp", 1), ("hf", 2)])
def test_anygpu_launch_from_an_empty_folder(venv, tmp_path, engine, nproc):
    """`anygpu launch --vendor nvidia --cpu --nproc N` from a folder with nothing in it: the engine runs as the
    installed module (`-m anygpu.engines.run_<engine>`), the HF engine with the installed accelerate config (2
    processes: one runs as plain python, no config). The FSDP2 engine's one process spares a fresh torchrun and
    rank; the module under torchrun: test_the_engine_modules_run_under_torchrun_accelerate_and_python."""
    cwd, out = tmp_path / "empty", tmp_path / "out"
    cwd.mkdir()
    launch = [str(venv / "bin" / "anygpu"), "launch", "--vendor", "nvidia", "--cpu", "--nproc", str(nproc)]
    launch += ["--engine", engine]
    proc = sh(
        [*launch, "--", *TINY, "--max_steps", "3", "--output_dir", str(out)], timeout=240, cwd=cwd, env=venv_env(venv)
    )
    site = site_packages(venv)
    exec_line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("[anygpu] exec: "))
    assert exec_line.startswith(f"[anygpu] exec: {venv / 'bin' / 'python'} -m ")
    assert exec_line.split(" -m ")[-1].startswith(f"anygpu.engines.run_{engine} --config_name tiny")
    if engine == "hf":
        assert f"--config_file {site / 'anygpu' / 'launch' / 'accelerate_configs' / 'ddp.yaml'} " in exec_line
    said = proc.stdout + proc.stderr
    assert str(ROOT / "anygpu") not in said and "standalone.py" not in said  # nothing ran from the repository
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in train] == [1, 2, 3] and {r["world_size"] for r in train} == {nproc}
    assert (out / "final" / "config.json").is_file() and list((out / "final").glob("*.safetensors"))
    assert list(cwd.iterdir()) == []  # the folder it ran in holds nothing afterwards


def test_the_engine_modules_run_under_torchrun_accelerate_and_python(tmp_path):
    """`-m anygpu.engines.run_<engine>` as each launcher runs it (ranks forked: tests/scripts/warm_launch.py and
    zygote.py): the same losses as each other, --help with the module's usage, a bad argument one line and exit 2."""
    tail = [*TINY, "--max_steps", "2", "--output_dir"]
    torchrun(2, "-m", ["anygpu.engines.run_fsdp", *tail, str(tmp_path / "torchrun")])
    accelerate_launch("ddp", 2, "-m", ["anygpu.engines.run_hf", *tail, str(tmp_path / "accelerate")])
    python("-m", ["anygpu.engines.run_fsdp", *tail, str(tmp_path / "python")])
    runs = {name: [r for r in records(tmp_path / name) if "loss" in r] for name in ("torchrun", "accelerate", "python")}
    assert {name: [(r["step"], r["world_size"]) for r in recs] for name, recs in runs.items()} == {
        "torchrun": [(1, 2), (2, 2)],
        "accelerate": [(1, 2), (2, 2)],
        "python": [(1, 1), (2, 1)],
    }
    ref = [r["loss"] for r in runs["python"]]
    for name in ("torchrun", "accelerate"):
        assert [r["loss"] for r in runs[name]] == pytest.approx(ref, rel=1e-5), name
    for engine in ("fsdp", "hf"):
        usage = python("-m", [f"anygpu.engines.run_{engine}", "--help"]).stdout.splitlines()[0]
        assert usage == f"usage: python -m anygpu.engines.run_{engine} [config.yaml] [--option value ...]"
        bad = python("-m", [f"anygpu.engines.run_{engine}", "--max_stepz", "1"], check=False)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--max_stepz" in bad.stderr, bad.stderr
