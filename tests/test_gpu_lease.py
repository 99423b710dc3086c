"""benchmarks/gpu_lease.sh without a GPU and without its venv: its plan (what it installs, runs and writes) is what a
15-minute lease can afford, every row is a valid engine command that writes no checkpoint, and one row of the
bench really runs here (the rehearsal in the device-like venv is docs/benchmarks.md's command, not the suite's)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
from conftest import ROOT

from anygpu.config.args import build_parser

ISSUE_ROWS = {  # what the lease must measure (issue 30), by row name
    "eager",
    "activation checkpointing, full",
    "activation checkpointing, selective",
    "compiled",
    "compiled + FP8 rowwise",
    "compiled + FP8 tensorwise",
    "the model's own loss (--lean_loss false)",
    "SFT rows, packed",
    "SFT rows, padded (--packing false)",
    # issue 43: packed rows' kernels, packed DPO pairs
    "SFT rows, packed, flex attention",
    "SFT rows, packed, varlen attention",
    "DPO pairs, packed",
    "DPO pairs, packed, varlen attention",
}


def lease(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/gpu_lease.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, "LEASE_SHAPES": "gpu", **env},
    )


@pytest.fixture(scope="module")
def plan_rows() -> list[dict]:
    work = Path("/tmp/lease-plan")
    work.mkdir(exist_ok=True)
    for name in ("sft.jsonl", "prompts.jsonl"):  # `prepare` writes them; the parser checks they are there
        (work / name).write_text('{"prompt": "a", "completion": "b"}\n')
    (work / "dpo.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    out = subprocess.run(
        [sys.executable, "benchmarks/lease_bench.py", "plan"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LEASE_SHAPES": "gpu", "LEASE_WORK": "/tmp/lease-plan"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def bench():
    """benchmarks/lease_bench.py as a module, with the GPU's shapes; what its import sets (HF's offline variables,
    warning filters) stays in the import."""
    spec = importlib.util.spec_from_file_location("lease_bench_under_test", ROOT / "benchmarks/lease_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    with mock.patch.dict(os.environ, {"LEASE_SHAPES": "gpu"}), warnings.catch_warnings():
        spec.loader.exec_module(module)
    return module


def test_the_plan_installs_our_pinned_wheels_and_says_the_device_calls():
    proc = lease("plan")
    assert proc.returncode == 0, proc.stderr
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()[1:] if "==" in line)
    wheels = dict(re.findall(r"^  ([\w.-]+)==([\w.+-]+)", proc.stdout, flags=re.MULTILINE))
    assert {"transformers", "datasets", "torchao"} <= wheels.keys()
    assert all(pins[name] == version for name, version in wheels.items()), wheels
    calls = re.findall(
        r"run\(command='(bash benchmarks/gpu_lease.sh \d)', carry=\['.whl'\], timeout_s=(\d+)\)", proc.stdout
    )
    assert [c for c, _ in calls] == [f"bash benchmarks/gpu_lease.sh {n}" for n in (1, 2, 3)]
    assert all(int(t) <= 600 for _, t in calls)  # the device's limit per command
    # 15 minutes of device time in all: the machine's start (~30 s on the H100 lease) and ~10 s per call around them
    assert 30 + sum(int(t) + 10 for _, t in calls) <= 900
    writes = re.search(r"writes under \$OUT: (.*)", proc.stdout)[1].split()
    assert len(writes) <= 8 and all("/" not in w for w in writes)  # what comes back: 8 files at most


def test_every_row_is_an_engine_command_that_writes_no_checkpoint(plan_rows):
    parser = build_parser()
    for row in plan_rows:
        argv = row["argv"]
        model_args, data_args, train_args = parser.parse_args_into_dataclasses(args=argv)
        assert train_args.save_strategy == "no" and not train_args.export_final, row["id"]
        assert train_args.output_dir.startswith("/tmp/lease-plan/runs/"), row["id"]  # not under $OUT
        assert train_args.bf16 and data_args.block_size == 8192
    assert {r["name"] for r in plan_rows} >= ISSUE_ROWS
    eager = {r["layers"] for r in plan_rows if r["name"] == "eager"}
    assert eager == {2, 4}  # the per-layer cost and the projection of an 8B step


def test_the_packed_rows_name_their_kernel_and_dpo_starts_from_a_saved_model(plan_rows):
    """Unnamed, packed rows on an NVIDIA GPU take varlen: the sdpa rows name sdpa. The DPO rows train pairs from the
    folder the row saves (--objective dpo starts from a pretrained model), with a frozen reference copy."""
    parser = build_parser()
    packed = [r for r in plan_rows if r["data"] in ("sft", "dpo") and "padded" not in r["name"]]
    for row in packed:
        model_args, data_args, train_args = parser.parse_args_into_dataclasses(args=row["argv"])
        assert model_args.attention_chosen, row["id"]
        kernel = (
            "varlen_attention" if "varlen" in row["name"] else "flex_attention" if "flex" in row["name"] else "sdpa"
        )
        assert model_args.attn_implementation == kernel, row["id"]
        if row["data"] == "dpo":
            assert train_args.objective == "dpo" and not train_args.precompute_ref_log_probs
            assert model_args.model_name_or_path == "/tmp/lease-plan/llama3-8b-shape-4L-pretrained"
            assert data_args.train_file == "/tmp/lease-plan/dpo.jsonl"
    assert sum(r["data"] == "dpo" for r in packed) == 2


def test_the_grpo_rows_sample_64_completions_of_512_tokens(plan_rows):
    """GRPO at 4 and 2 layers (generation's per-layer cost), late in part 1: 8 prompts of the SFT rows a step, 8
    completions of each, sampled to 512 tokens and trained on in micro-batches of 8, the demo's reward found by an
    absolute path (the engine resolves a relative one from where it runs)."""
    grpo = [r for r in plan_rows if r["data"] == "grpo"]
    assert sorted(r["layers"] for r in grpo) == [2, 4] and all(r["late"] and r["part"] == 1 for r in grpo)
    parser = build_parser()
    for row in grpo:
        _, data_args, train_args = parser.parse_args_into_dataclasses(args=row["argv"])
        assert train_args.objective == "grpo" and data_args.train_file == "/tmp/lease-plan/prompts.jsonl"
        path, fn = train_args.reward_funcs[0].rsplit(":", 1)
        assert fn == "digits" and path == str(ROOT / "examples/grpo/rewards.py") and Path(path).is_file()
        assert (train_args.global_batch_size, train_args.per_device_train_batch_size) == (64, 8)
        assert train_args.num_generations == 8
        assert (train_args.max_prompt_length, train_args.max_completion_length) == (512, 512)
        assert train_args.bf16 and not train_args.torch_compile
        assert (train_args.max_steps, train_args.logging_steps) == (4, 2)  # step 4's record: steps 3 and 4


def test_each_part_fits_its_call(plan_rows):
    """The rows' seconds as the H100 lease measured them fit each call's budget (255 s of a 280-s call); the late
    rows are the only ones planned to be skipped when time is short. Part 3 is the GPU tests alone."""
    for part, overhead in ((1, 80), (2, 40)):  # install, facts, prepare, and (part 1) the kernels: as measured
        main = sum(r["seconds"] for r in plan_rows if r["part"] == part and not r["late"])
        assert main + overhead <= 255, (part, main)
    assert {r["part"] for r in plan_rows} == {1, 2}


def test_the_table_and_the_projection(tmp_path):
    """The part's Markdown from its rows: failed and skipped rows say so; 8B's step from 4 and 2 layers."""
    rows = [
        {
            "kind": "row",
            "name": "eager",
            "layers": 2,
            "ms_per_step": 300.0,
            "tokens_per_second": 27306.0,
            "mfu": 0.4,
            "peak_memory_gib": 30.0,
            "host_syncs_per_step": 0,
            "graph_breaks": 0,
            "parameters": 1_486_000_000,
        },
        {
            "kind": "row",
            "name": "eager",
            "layers": 4,
            "ms_per_step": 400.0,
            "tokens_per_second": 20480.0,
            "mfu": 0.42,
            "peak_memory_gib": 40.0,
            "host_syncs_per_step": 0,
            "graph_breaks": 0,
            "parameters": 1_922_000_000,
        },
        {"kind": "row", "name": "compiled", "layers": 4, "status": "timed out after 150 s"},
        *(
            {
                "kind": "row",
                "name": "GRPO",
                "layers": layers,
                "ms_per_step": 1000 * (gen + 0.01 + train),
                "tokens_per_second": 64 * 800 / (gen + 0.01 + train),
                "peak_memory_gib": memory,
                "objective": "grpo",
                "completions": 64,
                "completion_tokens": 512.0,
                "prompt_tokens": 288.0,
                "generation_seconds": gen,
                "reward_seconds": 0.01,
                "training_seconds": train,
                "generated_tokens_per_second": 64 * 512 / gen,
                "training_tokens_per_second": 64 * 800 / train,
            }
            for layers, gen, train, memory in ((2, 3.0, 1.0, 30.0), (4, 4.0, 1.5, 42.0))
        ),
        {"kind": "row", "name": "GRPO", "layers": 8, "status": "skipped (time budget)"},
        {"kind": "gemm", "n": 8192, "bf16_tflops": 790.0, "fp8_tensorwise_tflops": 1400.0, "fp8_rowwise_tflops": None},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, "benchmarks/lease_bench.py", "table", "1", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LEASE_SHAPES": "gpu"},
    )
    assert out.returncode == 0, out.stderr
    assert "| eager | 4 | 400.0 | 20,480 | 42.0% | 40.0 | 0 | 0 |" in out.stdout
    assert "| compiled | 4 | timed out after 150 s |" in out.stdout
    # 50 ms a layer, 200 ms the rest: 200 + 32 × 50 = 1800 ms for 8B's 32 layers
    assert "50.0 ms per decoder layer, 200.0 ms the rest" in out.stdout and ": 1800 ms, 4,551 tokens/s" in out.stdout
    assert "bf16 790 TFLOP/s; FP8 tensorwise 1,400, rowwise – TFLOP/s" in out.stdout
    # GRPO's own table: the step split into sampling, rewards and training
    assert "| GRPO | 4 | 5.51 | 4.00 | 0.010 | 1.50 | 64 × (288 + 512) | 8,192 | 9,292 | 34,133 | 42.0 |" in out.stdout
    assert "| GRPO | 8 | skipped (time budget) |" in out.stdout and "| GRPO | 4 | 5510" not in out.stdout
    # sampling 0.5 s a layer, 2 s the rest: 2 + 32 × 0.5 = 18 s; training 0.5 + 32 × 0.25 = 8.5 s; + 0.01 s rewards
    assert "sampling 500 ms per decoder layer, 2000 ms the rest" in out.stdout
    assert "training 250 ms per layer, 500 ms the rest" in out.stdout
    assert "sampling 18.0 s (1,820 tokens/s), training 8.5 s, step 26.5 s, 68% of it sampling" in out.stdout


def test_the_profiled_rows_run_two_more_steps(plan_rows):
    """The FP8-against-bf16 rows and the packed SFT rows at 4 layers are profiled: two steps past the host-sync probe
    (a warm-up under the profiler, then the profiled step), the measured window unchanged."""
    profiled = {r["name"] for r in plan_rows if r["profile"]}
    assert {
        "compiled",
        "compiled + FP8 tensorwise",
        "compiled + FP8 rowwise",
        "SFT rows, packed",
        "SFT rows, packed, flex attention",
    } <= profiled
    parser = build_parser()
    for row in plan_rows:
        _, _, train_args = parser.parse_args_into_dataclasses(args=row["argv"])
        if row["data"] != "grpo":  # 2 windows of 8, the probe, and the profiled rows' two
            assert (train_args.max_steps, train_args.logging_steps) == (17 + 2 * row["profile"], 8), row["id"]
    assert all(r["layers"] == 4 for r in plan_rows if r["profile"])


H100_KERNELS = {  # names as the profiler shows them on an H100, and their kind
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "fp8 matmul",
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
    "cute::tuple<int, int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::float_e4m3_t>>>": "fp8 matmul",
    "nvjet_tst_192x192_64x4_1x2_h_bz_coopB_NTN": "matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true>(pytorch_flash::Flash_fwd_params)": (
        "attention"
    ),
    "fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<>)": "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "triton_red_fused_abs_amax_0": "fp8 cast/amax",
    "triton_poi_fused__to_copy_clamp_reciprocal_1": "fp8 cast/amax",
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "communication",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>": "optimizer",
    "Memcpy DtoD (Device -> Device)": "copies/memset",
    "Memset (Device)": "copies/memset",
    "void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>": (
        "copies/memset"
    ),
    "triton_poi_fused__to_copy_0": "copies/memset",
    "triton_per_fused__log_softmax_0": "loss/softmax",
    "triton_red_fused__log_softmax_amax_sub_1": "loss/softmax",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<c10::BFloat16, float, long>": (
        "loss/softmax"
    ),
    "triton_poi_fused_add_mul_silu_2": "other",
    "triton_poi_fused__to_copy_add_mul_3": "other",  # a cast fused into compute is compute
    "aten::mm": "matmul",  # the CPU rehearsal's ops
    "aten::_scaled_mm": "fp8 matmul",
}


def test_kernel_kinds_by_their_h100_names(bench):
    assert {name: bench.kernel_kind(name) for name in H100_KERNELS} == H100_KERNELS
    # cuBLAS's nvjet kernels do not name their operands' type: launched by torch._scaled_mm, they are FP8's
    assert bench.kernel_kind("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_NTN", fp8=True) == "fp8 matmul"
    assert bench.kernel_kind("triton_red_fused_abs_amax_0", fp8=True) == "fp8 cast/amax"  # not a matmul


def test_the_profile_summary_and_its_table(bench, tmp_path):
    """The profiled step by kind, its 8 longest kernels; the part's table of them, after the main table."""
    gemm, fp8 = "nvjet_tst_192x192_64x4_1x2_h_bz_coopB_NTN", "nvjet_qqtst_128x256_128x6_2x1_v_bz_coopA_TNT"
    timed = [(gemm, 1000.0)] * 3 + [(fp8, 2000.0), ("triton_red_fused_abs_amax_0", 500.0)]
    timed += [(f"triton_poi_fused_mul_{i}", 10.0) for i in range(10)] + [("Memset (Device)", 5.0)]
    summary = bench.profile_summary(timed, 10.0, "cuda", {fp8})
    assert summary["device"] == "cuda" and summary["step_ms"] == 10.0 and summary["kernel_ms"] == 5.605
    assert summary["kinds"] == {"fp8 matmul": 2.0, "matmul": 3.0, "fp8 cast/amax": 0.5, "copies/memset": 0.005,
                                "other": 0.1}  # fmt: skip
    assert summary["top"][:2] == [[gemm, 3.0, 3], [fp8, 2.0, 1]] and len(summary["top"]) == 8
    assert len(json.dumps(summary)) < 2000  # small: the row's record is one line of lease-N.jsonl
    rows = [
        {"kind": "row", "name": "compiled + FP8 tensorwise", "layers": 4, "ms_per_step": 9.0, "tokens_per_second": 1.0,
         "mfu": 0.5, "peak_memory_gib": 1.0, "host_syncs_per_step": 0, "graph_breaks": 0, "profile": summary},
        {"kind": "row", "name": "compiled", "layers": 4, "ms_per_step": 9.5, "tokens_per_second": 1.0, "mfu": 0.5,
         "peak_memory_gib": 1.0, "host_syncs_per_step": 0, "graph_breaks": 0,
         "profile": {"error": "profiler start: RuntimeError('CUPTI | busy')"}},
        {"kind": "row", "name": "eager", "layers": 4, "ms_per_step": 20.0, "tokens_per_second": 1.0, "mfu": 0.4,
         "peak_memory_gib": 1.0, "host_syncs_per_step": 0, "graph_breaks": 0},
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = bench.table(2, path)
    main, profiled = out.index("| configuration |"), out.index("Where the profiled step's GPU time goes (ms)")
    assert main < profiled and "rehearsal" not in out
    # kinds: fp8 matmul, communication, attention, matmul, optimizer, loss/softmax, fp8 cast/amax, copies, other
    cells = "| 2.0 | – | – | 3.0 | – | – | 0.5 | 0.0 | 0.1 |"
    assert f"| compiled + FP8 tensorwise | 4 | 9.0 | 10.0 | 5.6 | 4.4 {cells}" in out
    assert "| compiled | 4 | 9.5 | profiler start: RuntimeError('CUPTI \\| busy') |" in out
    assert f"- compiled + FP8 tensorwise (4 layers), longest: `{gemm}` 3.0 ms × 3; `{fp8}` 2.0 ms × 1" in out
    assert "| eager | 4 | 20.0 |" in out and "| eager | 4 | 20.0 | –" not in out.split("Where")[1]


def test_the_profile_counts_what_ran_in_the_profiled_step(bench):
    """The installed torch's profiler events, as `StepProfiler` reads them: only what ran from the mark on (the
    warm-up step's ops are not the profiled step's), the mark itself not an op."""
    import torch

    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.softmax(a, -1)  # the warm-up step
        with torch.profiler.record_function(bench.StepProfiler.MARK):
            a @ a
    names = {name for name, us in bench._timed_events(prof.events(), "cpu", bench.StepProfiler.MARK)}
    assert "aten::mm" in names and not {n for n in names if "softmax" in n or n == bench.StepProfiler.MARK}


@pytest.mark.slow
def test_part_3_runs_the_gpu_tests_no_lease_has_passed_first():
    """Every GPU test once (each marked test file's tests are there), the ones benchmarks/lease_gpu_tests_passed.txt
    lists last (a short lease proves new ones first); a parametrized id with spaces stays one id."""
    proc = lease("test-order")
    assert proc.returncode == 0, proc.stderr
    order = proc.stdout.splitlines()
    listed = (ROOT / "benchmarks/lease_gpu_tests_passed.txt").read_text().splitlines()
    passed = {line for line in listed if line and not line.startswith("#")}
    assert len(order) == len(set(order)) and passed and set(order[-len(passed) :]) == passed
    marked = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = \[?pytest\.mark\.gpu)", flags=re.MULTILINE)
    gpu_files = {p.name for p in (ROOT / "tests").glob("test_*.py") if marked.search(p.read_text())}
    assert {t.split("::")[0].removeprefix("tests/") for t in order} == gpu_files
    assert any(" " in test_id for test_id in order)


@pytest.mark.slow
def test_a_row_runs_the_engines_own_step_here(tmp_path):
    """One row of the bench for real, with the rehearsal's shapes: the engine trains (compiled, FP8), the figures are
    there, a step that does not log has no host sync, and the profiled step's ops are summarised (not dynamo's
    recompilation under the profiler: the warm-up step takes it)."""
    env = {**os.environ, "LEASE_SHAPES": "cpu", "LEASE_WORK": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "benchmarks/lease_bench.py", *a],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    proc = run("row", "compiled-fp8-tensorwise-4l")  # prepares what it reads first
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(re.search(r"^LEASE_ROW (.*)$", proc.stdout, flags=re.MULTILINE)[1])
    assert row["ms_per_step"] > 0 and row["tokens_per_second"] > 0 and row["host_syncs_per_step"] == 0
    assert row["parameters"] > 0 and row["graph_breaks"] == 0
    profile = row["profile"]
    assert profile["device"] == "cpu" and 0 < profile["kernel_ms"] <= profile["step_ms"], profile
    assert profile["kinds"]["matmul"] > 0 and profile["kinds"]["fp8 cast/amax"] > 0, profile
    assert not [name for name, _, _ in profile["top"] if "dynamo" in name], profile
    assert not list(tmp_path.glob("runs/*/checkpoint-*")) and not list(tmp_path.glob("runs/*/final"))


@pytest.mark.slow
def test_a_grpo_row_splits_its_step_here(tmp_path):
    """A GRPO row for real, with the rehearsal's shapes: its record says what sampling, scoring and training each
    cost a step, and the three add up to the step."""
    env = {**os.environ, "LEASE_SHAPES": "cpu", "LEASE_WORK": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/lease_bench.py", "row", "grpo-2l"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(re.search(r"^LEASE_ROW (.*)$", proc.stdout, flags=re.MULTILINE)[1])
    assert row["objective"] == "grpo" and row["completions"] == 16 and 0 < row["completion_tokens"] <= 16
    assert row["generation_seconds"] > 0 and row["reward_seconds"] > 0 and row["training_seconds"] > 0
    step = row["generation_seconds"] + row["reward_seconds"] + row["training_seconds"]
    assert abs(step - row["ms_per_step"] / 1000) < 1e-6
    assert row["generated_tokens_per_second"] > 0 and row["training_tokens_per_second"] > 0
    assert 0 < row["prompt_tokens"] <= 16  # cut to --max_prompt_length (the rehearsal's 16)
    assert not list(tmp_path.glob("runs/*/checkpoint-*")) and not list(tmp_path.glob("runs/*/final"))
