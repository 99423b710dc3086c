"""The GPU lease's measurements (`benchmarks/gpu_lease.sh` runs them): the native engine's own step on Llama-3-8B-
shaped models of a few layers at block 8192, one configuration per process, and the numbers around it.

    python benchmarks/lease_bench.py plan [--part N]     # the rows and their engine arguments, as JSON
    python benchmarks/lease_bench.py prepare             # tokenizer (8B's vocabulary) and SFT rows, in $LEASE_WORK
    python benchmarks/lease_bench.py row ID              # one configuration: LEASE_ROW {json}
    python benchmarks/lease_bench.py gemm                # the bf16 and FP8 matmul ceilings: LEASE_GEMM {json}
    python benchmarks/lease_bench.py cp                  # context parallelism's attention kernels at 128k, per rank
    python benchmarks/lease_bench.py facts               # the machine, as Markdown
    python benchmarks/lease_bench.py table PART ROWS.jsonl   # the Markdown table of a part, with the projection

A row is the engine's `FSDPTrainer.train()` on one GPU (bf16, FSDP2's mixed precision at one rank) for 2·W + 1 steps,
logged every W: the record of step 2·W is the steady state (compilation and warm-up are in the first), and the
last step's host syncs are counted (a profiled row runs two more under torch.profiler, a warm-up and one whose
device time is summarised by kernel kind). ms/step and
tokens/s are that window's, MFU the engine's own (against the bf16 peak, attention over each sample's length),
peak memory the engine's `max_memory_allocated`; host syncs are CUDA's own count over one step that does not
log (`anygpu.runtime.host_syncs`), graph breaks dynamo's count for the run. The model is Llama-3-8B's layer (hidden
4096, MLP 14336, 32 heads, 8 KV heads) and vocabulary (128,256: a BPE trained on the corpus, its table padded with
unused tokens, so the embedding and output projection have 8B's size) with 2 or 4 layers; the per-layer cost is the
difference of 4 and 2 layers, and 8B's step (32 layers) is projected from it.

The GRPO rows (`--objective grpo`, online RL) time a step that samples its own rows: GRPO_COMPLETIONS completions
(GRPO_GENERATIONS of each of the step's prompts: the SFT rows' non-blank prompts, cut to their last GRPO_PROMPT
tokens) of up to GRPO_TOKENS tokens with HF's generate and a KV cache, scored by examples/grpo/rewards.py:digits,
then trained on in micro-batches of GRPO_MICRO. Their record adds the round's sampling and scoring seconds (the
engine's `generation_seconds`, `reward_seconds`, averaged over the measured window) and the training part: the step
less both. A random-init model samples its EOS about once in 128,256 tokens, so nearly every completion runs to
GRPO_TOKENS: the worst case, which is what a cost measurement wants (`clipped_ratio` says how near).

Without a GPU everything runs with shrunken shapes on the CPU (the rehearsal: the same code, minutes not hours);
LEASE_SHAPES=gpu or cpu chooses the shapes whatever the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import anygpu  # noqa: E402

anygpu.set_offline_defaults()
anygpu.quiet_library_warnings()


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# The shapes: the GPU's where there is one, else the rehearsal's; LEASE_SHAPES=gpu|cpu chooses them (a plan, a quick
# check: torch is then imported only where a row, a kernel or the facts need it)
GPU = {"gpu": True, "cpu": False}[os.environ["LEASE_SHAPES"]] if os.environ.get("LEASE_SHAPES") else _has_gpu()
WORK = Path(os.environ.get("LEASE_WORK", "/tmp/anygpu-lease"))

# Llama-3-8B's layer and vocabulary (anygpu/config/presets/llama-8b.json), or the rehearsal's shrunken ones.
SHAPE = (
    dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    if GPU
    else dict(hidden_size=128, intermediate_size=448, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024)
)
# Qwen3-30B-A3B's layer (128 experts, 8 per token, 3.3B of 30.5B parameters active), with the same vocabulary
MOE_SHAPE = (
    dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
         num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
    if GPU
    else dict(hidden_size=128, intermediate_size=448, moe_intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2)
)  # fmt: skip
BLOCK = 8192 if GPU else 256
WINDOW = 8 if GPU else 1  # steps per logged window: the second window is measured
SFT_BATCH = 4  # sequences per step of the SFT rows (packed rows, or samples padded to the micro-batch's longest)
# GRPO rows: completions per step and per micro-batch, completions of each prompt, prompt tokens kept (the last ones),
# the most tokens sampled; GRPO_WINDOW steps per logged window (each step generates: fewer, longer steps)
GRPO_COMPLETIONS, GRPO_MICRO, GRPO_GENERATIONS = (64, 8, 8) if GPU else (16, 8, 4)
GRPO_PROMPT, GRPO_TOKENS = (512, 512) if GPU else (16, 16)
GRPO_WINDOW = 2 if GPU else 1
GRPO_REWARD = f"{ROOT / 'examples/grpo/rewards.py'}:digits"  # absolute: the engine resolves it from its working dir
CP_TOKENS = 131072 if GPU else 2048
CORPUS_MB = 8 if GPU else 1
EIGHT_B_LAYERS = 32


@dataclass(frozen=True)
class Row:
    name: str
    part: int  # which device call runs it (gpu_lease.sh 1 or 2; 3 runs the GPU tests)
    layers: int
    args: tuple[str, ...] = ()
    data: str = "text"  # raw-text blocks, "sft": prompt-completion rows, "dpo": preference pairs, "grpo": prompts
    seconds: int = 30  # expected on an H100, start-up included (the part's time budget skips what would not fit)
    late: bool = False  # last, in the time the part's budget leaves (planned to be skipped when time is short)
    moe: bool = False  # Qwen3-30B-A3B's mixture-of-experts layer (`MOE_SHAPE`) instead of Llama-3-8B's
    profile: bool = False  # one more step, under torch.profiler: where its device time goes (`profile_summary`)

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", f"{self.name} {self.layers}L".lower()).strip("-")


COMPILE = ("--torch_compile", "true")
MICRO_2 = ("--global_batch_size", "2", "--per_device_train_batch_size", "2")  # after the row's own: these win
ROWS = (  # seconds: measured on the H100 lease of 2026-11-26 (~30 s of each is the process's start and the model's build)
    Row("eager", 1, 2, seconds=40),
    Row("eager", 1, 4, seconds=40),
    Row("the model's own loss (--lean_loss false)", 1, 4, ("--lean_loss", "false"), seconds=40),
    Row("activation checkpointing, full", 1, 4, ("--gradient_checkpointing", "true"), seconds=40),
    Row(
        "activation checkpointing, selective",
        1,
        4,
        ("--gradient_checkpointing_policy", "selective"),
        seconds=40,
        late=True,
    ),
    Row("compiled", 2, 4, COMPILE, seconds=55, profile=True),
    Row("compiled + FP8 tensorwise", 2, 4, (*COMPILE, "--fp8", "tensorwise"), seconds=55, profile=True),
    Row("compiled + FP8 rowwise", 2, 4, (*COMPILE, "--fp8", "rowwise"), seconds=55, profile=True),
    # sdpa named: with --attn_implementation left out, packed rows on an NVIDIA GPU take varlen_attention
    Row("SFT rows, packed", 2, 4, ("--attn_implementation", "sdpa"), "sft", seconds=45, profile=True),
    Row("compiled + FP8 rowwise", 2, 2, (*COMPILE, "--fp8", "rowwise"), seconds=55, late=True),
    # FP8's GEMMs ran 1.38x bf16's at 8192 tokens a GEMM (the H200 lease): twice the tokens a micro-batch, both ways
    Row("compiled, micro-batch 2", 2, 4, (*COMPILE, *MICRO_2), seconds=60, late=True, profile=True),
    Row(
        "compiled + FP8 tensorwise, micro-batch 2",
        2,
        4,
        (*COMPILE, "--fp8", "tensorwise", *MICRO_2),
        seconds=60,
        late=True,
        profile=True,
    ),  # fmt: skip
    Row("SFT rows, padded (--packing false)", 2, 4, ("--packing", "false"), "sft", seconds=40, late=True),
    # packed rows' samples confined by flex attention's document block mask instead of sdpa's dense (T × T) mask: the
    # target is ≥ 0.9× the plain rows' tokens/s (seconds: a guess, flex_attention and the mask builder compile first)
    Row(
        "SFT rows, packed, flex attention",
        2,
        4,
        ("--attn_implementation", "flex_attention"),
        "sft",
        seconds=70,
        late=True,
        profile=True,
    ),
    # the samples' offsets to torch's own varlen kernel (flash attention inside torch; no flash-attn package, no mask)
    Row(
        "SFT rows, packed, varlen attention",
        2,
        4,
        ("--attn_implementation", "varlen_attention"),
        "sft",
        seconds=50,
        late=True,
        profile=True,
    ),
    # preference pairs (--objective dpo from scratch, the reference a frozen copy) packed into 8192-token rows:
    # sdpa's dense mask, then varlen (the default for packed rows on an NVIDIA GPU)
    Row("DPO pairs, packed", 2, 4, ("--attn_implementation", "sdpa"), "dpo", seconds=60, late=True),
    Row(
        "DPO pairs, packed, varlen attention",
        2,
        4,
        ("--attn_implementation", "varlen_attention"),
        "dpo",
        seconds=55,
        late=True,
    ),  # fmt: skip
    Row(
        "compiled + selective checkpointing",
        2,
        4,
        (*COMPILE, "--gradient_checkpointing_policy", "selective"),
        seconds=55,
        late=True,
    ),
    # the experts computed together (one grouped GEMM per projection, transformers' default) or by the family's loop
    # over the experts hit: the single-GPU half of expert parallelism's speed (docs/moe.md); --ep needs two GPUs
    Row("MoE, experts grouped_mm", 1, 2, moe=True, seconds=45, late=True),
    Row("MoE, experts eager loop", 1, 2, ("--experts_implementation", "eager"), moe=True, seconds=60, late=True),
    # online RL: sampling 64 completions of 512 tokens against training on them, at 4 and 2 layers (generation's
    # per-layer cost: decoding reads every layer's weights at every token). seconds: a guess (no GPU has run them)
    Row("GRPO", 1, 4, data="grpo", seconds=90, late=True),
    Row("GRPO", 1, 2, data="grpo", seconds=70, late=True),
)


def row_by_id(row_id: str) -> Row:
    found = [r for r in ROWS if r.id == row_id]
    if not found:
        raise SystemExit(f"no row {row_id!r}: one of {', '.join(r.id for r in ROWS)}")
    return found[0]


def config_path(layers: int, moe: bool = False) -> Path:
    return WORK / (f"qwen3-30b-a3b-shape-{layers}L.json" if moe else f"llama3-8b-shape-{layers}L.json")


def window(row: Row) -> int:
    """Steps per logged window: the second window is measured."""
    return GRPO_WINDOW if row.data == "grpo" else WINDOW


def num_steps(row: Row) -> int:
    """Two windows, then (not GRPO) one step whose host syncs are counted: a GRPO step's generation syncs at every
    token by design (HF's stopping check), and a step less spares a GPU several seconds. A profiled row has two more
    under torch.profiler (a warm-up and the profiled step): past the window and the probe, changing neither."""
    return 2 * window(row) + (row.data != "grpo") + 2 * row.profile


def profiled_step(row: Row) -> int | None:
    """The step summarised under torch.profiler (the last; the one before runs under it too: `StepProfiler`)."""
    return num_steps(row) if row.profile else None


def engine_argv(row: Row) -> list[str]:
    """The row's run_fsdp_standalone.py arguments: no checkpoint, no export, a short final evaluation."""
    batch, micro = {
        "text": (1, 1),
        "sft": (SFT_BATCH, SFT_BATCH),
        "dpo": (SFT_BATCH, SFT_BATCH),  # pairs: each pair's two sequences packed beside the others
        "grpo": (GRPO_COMPLETIONS, GRPO_MICRO),
    }[row.data]
    data = {
        "text": ["--max_corpus_mb", str(CORPUS_MB)],
        "sft": ["--train_file", str(WORK / "sft.jsonl")],
        "dpo": ["--train_file", str(WORK / "dpo.jsonl"), "--objective", "dpo", "--precompute_ref_log_probs", "false"],
        "grpo": ["--train_file", str(WORK / "prompts.jsonl")],
    }[row.data] + ["--max_eval_samples", "1"]
    if row.data == "grpo":
        data += [
            "--objective", "grpo", "--reward_funcs", GRPO_REWARD, "--num_generations", str(GRPO_GENERATIONS),
            "--max_prompt_length", str(GRPO_PROMPT), "--max_completion_length", str(GRPO_TOKENS),
        ]  # fmt: skip
    return [
        *(("--model_name_or_path", str(pretrained_path(row.layers))) if row.data == "dpo" else ()),
        *(("--config_name", str(config_path(row.layers, row.moe))) if row.data != "dpo" else ()),
        "--tokenizer_name",
        str(WORK / "tokenizer"),
        *data,
        "--block_size",
        str(BLOCK),
        "--bf16",
        "true",
        "--global_batch_size",
        str(batch),
        "--per_device_train_batch_size",
        str(micro),
        "--max_steps",
        str(num_steps(row)),  # a last step past the measured window: its host syncs are counted
        "--logging_steps",
        str(window(row)),
        "--warmup_steps",
        "1",
        "--eval_steps",
        "0",
        "--eval_on_start",
        "false",
        "--save_strategy",
        "no",
        "--export_final",
        "false",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--data_cache_dir",
        str(WORK / "cache"),
        "--output_dir",
        str(WORK / "runs" / row.id),
        "--overwrite_output_dir",
        "true",
        *row.args,
    ]


# ------------------------------------------------------------------------------------------------ prepare
def prepare() -> None:
    """The model configs, a tokenizer with Llama-3-8B's vocabulary size, prompt-completion rows, GRPO's prompts."""
    WORK.mkdir(parents=True, exist_ok=True)
    preset = json.loads((ROOT / "anygpu/config/presets/llama-8b.json").read_text())
    moe = {"model_type": "qwen3_moe", "vocab_size": SHAPE["vocab_size"], "rope_theta": 1e6, **MOE_SHAPE}
    for layers, is_moe in sorted({(r.layers, r.moe) for r in ROWS}):
        config = {**(moe if is_moe else {**preset, **SHAPE}), "num_hidden_layers": layers}
        config["max_position_embeddings"] = max(BLOCK, 8192)
        text = json.dumps(config, indent=1)
        path = config_path(layers, is_moe)
        if not path.exists() or path.read_text() != text:
            write_whole(path, text)
    if not (WORK / "tokenizer" / "tokenizer.json").exists():
        padded_tokenizer(WORK / "tokenizer", SHAPE["vocab_size"])
    if not (WORK / "sft.jsonl").exists():
        sft_rows(WORK / "sft.jsonl")
    if not (WORK / "prompts.jsonl").exists():
        prompt_rows(WORK / "sft.jsonl", WORK / "prompts.jsonl")
    if not (WORK / "dpo.jsonl").exists():
        preference_rows(WORK / "sft.jsonl", WORK / "dpo.jsonl")


def corpus_texts(max_mb: float) -> list[str]:
    from anygpu.data.sources import stdlib_files

    texts, size = [], 0
    for path in stdlib_files():
        text = path.read_text(errors="replace")
        texts.append(text)
        size += len(text)
        if size > max_mb * 1e6:
            break
    return texts


def padded_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a slice of the corpus, its vocabulary table padded with unused entries to
    `vocab_size`: the model's embedding and output projection get that size (the engine sizes the vocabulary from
    the tokenizer), and tokenising stays the fast small BPE."""
    from transformers import PreTrainedTokenizerFast

    from anygpu.data.tokenizer import train_bpe

    tok = train_bpe(corpus_texts(4 if GPU else 0.5), min(vocab_size, 8192))
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<|unused_{i}|>"] = i
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    padded = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        model_max_length=1 << 30,
    )
    assert len(padded) == vocab_size, (len(padded), vocab_size)
    padded.save_pretrained(str(folder))


def sft_rows(path: Path, count: int = 1500) -> None:
    """Prompt-completion rows cut from the corpus: prompts of 50-2,000 characters, completions of 200-12,000 (a
    few hundred to a few thousand tokens: several to a row of 8192)."""
    rng = random.Random(0)
    text = "\n".join(corpus_texts(CORPUS_MB))
    scale = 1.0 if GPU else 0.03
    with path.open("w") as f:
        for _ in range(count if GPU else 200):
            p, c = int(rng.randint(50, 2000) * scale) + 20, int(rng.randint(200, 12000) * scale) + 20
            at = rng.randrange(0, max(1, len(text) - p - c))
            f.write(json.dumps({"prompt": text[at : at + p], "completion": text[at + p : at + p + c]}) + "\n")


def write_whole(path: Path, text: str) -> None:
    """`text` as `path`, whole or not at all: rows start side by side in the rehearsal, and one may read it while
    another writes it."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prompt_rows(sft: Path, path: Path) -> None:
    """The GRPO rows' prompts: the SFT rows whose prompt is not blank (a cut of the corpus can be all spaces, which
    grpo refuses), their `completion` kept (grpo keeps the column and passes it to no reward function)."""
    rows = [line for line in sft.read_text().splitlines() if json.loads(line)["prompt"].strip()]
    write_whole(path, "".join(line + "\n" for line in rows))


def preference_rows(sft: Path, path: Path) -> None:
    """The DPO rows' pairs: each SFT row's prompt, its own completion chosen, the next row's rejected."""
    rows = [json.loads(line) for line in sft.read_text().splitlines()]
    pairs = [
        {"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
        for a, b in zip(rows, rows[1:] + rows[:1])
        if a["prompt"].strip()
    ]
    write_whole(path, "".join(json.dumps(p) + "\n" for p in pairs))


# ------------------------------------------------------------------------------------------------ profile
# Kernel kinds by (lowercased) name, first match wins; H100's names. Attention comes before the matmuls: FlashAttention's
# and mem-efficient attention's names carry cutlass:: in their template arguments. "::mm" etc. are the CPU rehearsal's
# aten ops (no GPU kernel name has them).
MATMUL = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "scaled_mm", "splitk", "::mm", "::addmm", "::bmm")
FP8 = ("e4m3", "e5m2", "f8", "fp8")
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "flex", "sdpa", "cudnn", "efficient")),
    ("matmul", MATMUL),  # "fp8 matmul" where FP8 operands show (`kernel_kind`)
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("loss/softmax", ("cross_entropy", "log_softmax", "softmax", "logsumexp", "nll")),  # before amax: softmax's max
    ("fp8 cast/amax", ("amax", "abs", "clamp", "to_fp8", "float8", "e4m3", "fp8", "reciprocal")),
    ("copies/memset", ("memcpy", "memset", "copy")),
)
KIND_NAMES = ("fp8 matmul", *(k for k, _ in KINDS), "other")


def kernel_kind(name: str, fp8: bool = False) -> str:
    """The kind of a kernel (or, on the CPU, an op) by its name; `fp8`: launched by torch._scaled_mm (cuBLAS's nvjet
    kernels do not say their operands' type in their name)."""
    low = name.lower()
    if re.fullmatch(r"triton_[a-z]+_fused__?(to_copy|clone|copy)_\d+", low):
        return "copies/memset"  # inductor's kernel of a cast or a copy alone
    for kind, words in KINDS:
        if kind == "copies/memset" and low.startswith("triton"):
            continue  # inductor's kernels are named after their ops, _to_copy (a cast) among them: fused, compute
        if any(w in low for w in words):
            if kind == "matmul" and (fp8 or "scaled_mm" in low or any(w in low for w in FP8)):
                return "fp8 matmul"
            return kind
    return "other"


def _fp8_kernels(events) -> set[str]:
    """The names of the kernels torch._scaled_mm launched (the profile's CPU ops know their kernels)."""
    return {k.name for e in events if "scaled_mm" in e.name for k in getattr(e, "kernels", ())}


def _timed_events(events, device: str, mark: str) -> list[tuple[str, float]]:
    """(name, µs) of what ran from the start of the `mark` range on: on a GPU its kernels, memcpys and memsets (not
    the GPU-side copies of record_function ranges, which would count their kernels twice); on the CPU each op's
    self time. Kineto puts the GPU's timestamps on the CPU's clock; the step before ended synchronized."""
    from torch.autograd import DeviceType

    marks = [e.time_range.start for e in events if e.name == mark and e.device_type == DeviceType.CPU]
    since = min(marks) if marks else 0
    ran = [e for e in events if e.time_range.start >= since and e.name != mark]
    if device == "cuda":
        kept = [e for e in ran if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        return [(e.name, e.time_range.elapsed_us()) for e in kept]
    cpu = [e for e in ran if e.device_type == DeviceType.CPU and not e.is_async]
    return [(e.name, e.self_cpu_time_total) for e in cpu if e.self_cpu_time_total > 0]


def profile_summary(
    timed: list[tuple[str, float]], step_ms: float, device: str, fp8: set[str] | frozenset[str] = frozenset()
) -> dict:
    """A profiled step, small: its wall ms, the ms of what ran (kernels; the CPU's ops), those ms by kind, the 8
    longest kernels (ms, calls)."""
    kinds, by_name = dict.fromkeys(KIND_NAMES, 0.0), {}
    for name, us in timed:
        kinds[kernel_kind(name, name in fp8)] += us / 1000
        ms, calls = by_name.get(name, (0.0, 0))
        by_name[name] = (ms + us / 1000, calls + 1)
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:8]
    return {
        "device": device,
        "step_ms": round(step_ms, 3),
        "kernel_ms": round(sum(kinds.values()), 3),
        "kinds": {k: round(ms, 3) for k, ms in kinds.items() if ms > 0},
        "top": [[name[:80], round(ms, 3), calls] for name, (ms, calls) in top],
    }


class StepProfiler:
    """torch.profiler over a row's last two steps, the second summarised (`profile_summary`): with the profiler on,
    dynamo compiles some frames again the first time (torchao's Float8TrainingTensor.__torch_dispatch__, 5 frames
    in the rehearsal), which would count their compilation as the step's. Never fails the row: an error is recorded
    (`{"error": ...}`), and a step that raised under the profiler returns the previous step's output (the row's
    figures are measured already; the engine only logs these steps)."""

    MARK = "lease: the profiled step"  # a record_function range: what ran from its start on is the profiled step's

    def __init__(self, device) -> None:
        import torch

        self.torch, self.device, self.on_gpu = torch, device, device.type == "cuda"
        self.prof, self.summary = None, {}

    def sync(self) -> None:
        if self.on_gpu:
            self.torch.cuda.synchronize(self.device)

    def warm(self, step_of, step: int, cpu, fallback) -> object:
        """The first step under the profiler (not summarised)."""
        torch = self.torch
        self.sync()  # the probe step's kernels are not the profile's
        try:
            activities = [torch.profiler.ProfilerActivity.CPU]  # the CPU ops: which kernels torch._scaled_mm launched
            activities += [torch.profiler.ProfilerActivity.CUDA] if self.on_gpu else []
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        except Exception as e:  # noqa: BLE001 (the row's timing matters more than its profile)
            self.prof, self.summary = None, {"error": f"profiler start: {e!r}"[:300]}
            return step_of(step, cpu)
        return self._guarded(step_of, step, cpu, fallback)

    def measure(self, step_of, step: int, cpu, fallback) -> object:
        """The profiled step: its wall time from a synchronized start to a synchronized end, then the summary."""
        if self.prof is None or self.summary:  # the profiler did not start, or the warm-up step raised
            self._stop()
            return step_of(step, cpu) if self.prof is None else fallback
        self.sync()
        start = time.perf_counter()
        with self.torch.profiler.record_function(self.MARK):
            out = self._guarded(step_of, step, cpu, fallback)
        step_ms = 1000 * (time.perf_counter() - start)
        if self._stop() and not self.summary:
            try:
                events = self.prof.events()
                kind = "cuda" if self.on_gpu else "cpu"
                timed = _timed_events(events, kind, self.MARK)
                self.summary = profile_summary(timed, step_ms, kind, _fp8_kernels(events))
            except Exception as e:  # noqa: BLE001
                self.summary = {"error": f"profile summary: {e!r}"[:300]}
        return out

    def _guarded(self, step_of, step: int, cpu, fallback) -> object:
        try:
            out = step_of(step, cpu)
            self.sync()
            return out
        except Exception as e:  # noqa: BLE001
            self.summary = self.summary or {"error": f"step {step} under the profiler: {e!r}"[:300]}
            return fallback

    def _stop(self) -> bool:
        if self.prof is None:
            return False
        try:
            self.prof.stop()
            return True
        except Exception as e:  # noqa: BLE001
            self.summary = self.summary or {"error": f"profiler stop: {e!r}"[:300]}
            return False


# ------------------------------------------------------------------------------------------------ one row
def pretrained_path(layers: int) -> Path:
    return WORK / f"llama3-8b-shape-{layers}L-pretrained"


def save_pretrained_model(layers: int) -> None:
    """A 'pretrained' folder for the DPO rows (--objective dpo starts from one): the config's model with
    transformers' own random initialisation, built on the GPU in bf16 (seconds, not the CPU's minutes), saved as
    safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = pretrained_path(layers)
    if (folder / "config.json").exists():
        return
    config = AutoConfig.from_pretrained(config_path(layers))
    torch.manual_seed(0)
    with torch.device("cuda" if GPU else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_suffix(f".{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    os.replace(tmp, folder)


def run_row(row: Row) -> dict:
    """Train the row's configuration with the engine; its steady-state figures."""
    import torch

    if row.data == "dpo":
        save_pretrained_model(row.layers)

    from anygpu.config.args import parse_args
    from anygpu.engines import fsdp as fsdp_engine
    from anygpu.runtime import compile_stats, host_syncs
    from anygpu.train.metrics import read_metrics

    trainer = fsdp_engine.FSDPTrainer(*parse_args(engine_argv(row)))
    w, grpo_row = window(row), row.data == "grpo"
    device, probe, counted, rounds = trainer.info.device, 2 * w + 1, {}, {}
    step_of, record_of = trainer.optimizer_step, trainer.log.train
    profiled, profiler, last_out = profiled_step(row), StepProfiler(device), [None]

    def optimizer_step(step, cpu):
        if grpo_row and device.type == "cuda":
            # the host runs ahead: without this the round's sampling clock (`generation_seconds`) would start while
            # the last step's backward and optimizer still run, and count them as sampling
            torch.cuda.synchronize(device)
        if step == probe:
            with host_syncs.count(device) as syncs:
                out = step_of(step, cpu)
            counted.update(count=syncs.count, where=syncs.summary(3))
        # the engine's optimizer_step is the whole step (forward, backward, clip, AdamW): profiled from end to end
        elif profiled and step == profiled - 1:
            out = profiler.warm(step_of, step, cpu, last_out[0])
        elif step == profiled:
            out = profiler.measure(step_of, step, cpu, last_out[0])
        else:
            out = step_of(step, cpu)
        last_out[0] = out  # a step that raised under the profiler returns it: the engine logs something
        if grpo_row:  # the step's round (one a step: --num_iterations 1): its sampling and scoring seconds
            rounds[step] = trainer.objective.round.metrics
        return out

    window_tokens = {}  # logged step → the real tokens of its window, as the engine's tokens/s counted them

    def train_record(step, *args, **kwargs):
        window_tokens[step] = trainer.log.window.tokens
        return record_of(step, *args, **kwargs)

    trainer.optimizer_step, trainer.log.train = optimizer_step, train_record
    before = compile_stats.counts()
    trainer.train()
    records = [r for r in read_metrics(WORK / "runs" / row.id / "metrics.jsonl") if "loss" in r]
    last = next(r for r in records if r["step"] == 2 * w)  # steps W+1 … 2W: compiled and warm
    seconds = window_tokens[2 * w] / last["tokens_per_second"]
    out = {
        "id": row.id,
        "name": row.name,
        "layers": row.layers,
        "ms_per_step": 1000 * seconds / w,
        "tokens_per_second": last["tokens_per_second"],
        "mfu": last.get("mfu"),
        "peak_memory_gib": last.get("max_memory_allocated_gb"),
        "host_syncs_per_step": counted.get("count"),
        "sync_sites": counted.get("where"),
        "graph_breaks": compile_stats.counts().since(before).graph_breaks,
        "loss": last["loss"],
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }
    if profiled:
        out["profile"] = profiler.summary or {"error": "no profile (the profiled step did not run)"}
    if grpo_row:
        out.update(grpo_figures([rounds[s] for s in range(w + 1, 2 * w + 1)], seconds / w, window_tokens[2 * w] / w))
    return out


def grpo_figures(rounds: list[dict], step_seconds: float, row_tokens: float) -> dict:
    """A GRPO row's step split: sampling (the slowest rank's, the engine's `generation_seconds`), scoring, and the
    rest (the training rows' forward and backward, the optimizer), averaged over the measured window's rounds;
    `row_tokens`: the real tokens (prompt + completion) a step trains on."""
    mean = lambda key: sum(r[key] for r in rounds) / len(rounds)  # noqa: E731
    generation, rewards, length = mean("generation_seconds"), mean("reward_seconds"), mean("completions/mean_length")
    training = step_seconds - generation - rewards
    return {
        "objective": "grpo",
        "completions": GRPO_COMPLETIONS,
        "max_completion_tokens": GRPO_TOKENS,
        "completion_tokens": length,  # the mean; GRPO_TOKENS where no completion sampled its EOS
        "clipped_ratio": mean("completions/clipped_ratio"),
        "prompt_tokens": row_tokens / GRPO_COMPLETIONS - length,  # the mean, after --max_prompt_length's cut
        "generation_seconds": generation,
        "reward_seconds": rewards,
        "training_seconds": training,
        "generated_tokens_per_second": GRPO_COMPLETIONS * length / generation,
        "training_tokens_per_second": row_tokens / training if training > 0 else None,
    }


# ------------------------------------------------------------------------------------------------ kernels
def timed(fn, repeat: int) -> float:
    """Seconds per call (after two warm-up calls), CUDA events on a GPU."""
    import torch

    for _ in range(2):
        fn()
    if GPU:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeat
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def gemm() -> dict:
    """The matmul ceilings: bf16, and FP8 (e4m3) with a tensor-wide and with row-wise scales (`torch._scaled_mm`)."""
    import torch

    n = 8192 if GPU else 512
    device = "cuda" if GPU else "cpu"
    a, b = (
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
    )
    out = {"n": n, "bf16_tflops": 2 * n**3 / timed(lambda: a @ b, 20 if GPU else 2) / 1e12}
    fp8 = torch.float8_e4m3fnuz if getattr(torch.version, "hip", None) else torch.float8_e4m3fn
    a8, b8 = a.to(fp8), b.to(fp8).t().contiguous().t()  # _scaled_mm: the second operand column-major
    scales = {
        "tensorwise": (torch.ones((), device=device), torch.ones((), device=device)),
        "rowwise": (torch.ones(n, 1, device=device), torch.ones(1, n, device=device)),
    }
    for kind, (sa, sb) in scales.items():
        try:
            call = lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
            out[f"fp8_{kind}_tflops"] = 2 * n**3 / timed(call, 20 if GPU else 2) / 1e12
        except (RuntimeError, NotImplementedError) as e:
            out[f"fp8_{kind}_tflops"] = None
            out[f"fp8_{kind}_error"] = str(e).splitlines()[0][:160]
    return out


def cp_kernels() -> list[dict]:
    """Per rank, forward + backward of the attention kernel context parallelism runs at CP_TOKENS tokens (one GPU
    times what one rank of C computes; the all-to-all and all-gather need C GPUs): Ulysses (the whole sequence,
    H/C heads, causal) for C = 1, 2, 4, 8, and the gathered path (T/C queries, every head, against the gathered keys
    and values under a boolean mask: heads C does not divide) for C = 8."""
    import torch

    heads, kv, d, t = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], 128 if GPU else 32, CP_TOKENS
    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    out = []
    for kind, c in (("ulysses", 1), ("ulysses", 2), ("ulysses", 4), ("ulysses", 8), ("gathered", 8)):
        hq, queries = (heads // c, t) if kind == "ulysses" else (heads, t // c)
        hk = max(1, kv // c) if kind == "ulysses" else kv
        try:
            seconds = timed(_attention_step(hq, hk, queries, t, d, kind == "gathered", device, dtype), 3 if GPU else 1)
            flops = 4 * queries * t * d * hq * (1.0 if kind == "gathered" else 0.5) * 3.5  # causal; fwd + 2.5x bwd
            out.append({"kind": kind, "cp": c, "tokens": t, "ms": 1000 * seconds, "tflops": flops / seconds / 1e12})
        except torch.OutOfMemoryError as e:
            out.append({"kind": kind, "cp": c, "tokens": t, "ms": None, "error": str(e).splitlines()[0][:120]})
        if GPU:
            torch.cuda.empty_cache()
    return out


def _attention_step(hq: int, hk: int, queries: int, t: int, d: int, gathered: bool, device, dtype):
    """sdpa forward + backward on [1, heads, tokens, d]; gathered: this rank's rows of the causal mask (the last
    rank's, the most work) as a boolean mask, as `anygpu.runtime.context_parallel` passes it."""
    import torch

    import torch.nn.functional as F

    q = torch.randn(1, hq, queries, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hk, t, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hk, t, d, device=device, dtype=dtype, requires_grad=True)
    mask = None
    if gathered:
        rows = torch.arange(t - queries, t, device=device)
        mask = rows[:, None] >= torch.arange(t, device=device)[None, :]

    def step() -> None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        o.sum().backward()

    return step


# ------------------------------------------------------------------------------------------------ report
def facts() -> str:
    import torch

    import platform
    from importlib import metadata

    lines = [f"- python {platform.python_version()}, torch {torch.__version__}"]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(
            f"- {torch.cuda.get_device_name(0)}: {p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}, "
            f"{p.multi_processor_count} SMs, CUDA {torch.version.cuda}"
        )
    else:
        lines.append(f"- no GPU: the rehearsal's shrunken shapes on {os.cpu_count()} CPU cores")
    names = ("transformers", "accelerate", "datasets", "torchao", "tokenizers", "safetensors", "peft", "pyarrow")
    versions = []
    for name in (*names, "numpy", "huggingface-hub", "triton", "flash-attn", "deepspeed"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} -")
    lines.append("- " + ", ".join(versions))
    return "\n".join(lines)


def projection(rows: list[dict], name: str) -> str | None:
    """8B's step from the difference of 4 and 2 layers of one configuration (same vocabulary, same block)."""
    by = {r["layers"]: r for r in rows if r["name"] == name and r.get("ms_per_step")}
    if 2 not in by or 4 not in by:
        return None
    per_layer = (by[4]["ms_per_step"] - by[2]["ms_per_step"]) / 2
    rest = by[2]["ms_per_step"] - 2 * per_layer
    if per_layer <= 0 or rest < 0:
        return f"{name}: 4 layers were not slower than 2 ({by[4]['ms_per_step']:.1f} vs {by[2]['ms_per_step']:.1f} ms): noise, no projection"
    step = rest + EIGHT_B_LAYERS * per_layer
    layer_params = (by[4]["parameters"] - by[2]["parameters"]) // 2
    params = by[2]["parameters"] - 2 * layer_params + EIGHT_B_LAYERS * layer_params
    vocab = SHAPE["vocab_size"] * SHAPE["hidden_size"]
    flops = BLOCK * (6 * (params - vocab) + 12 * EIGHT_B_LAYERS * SHAPE["hidden_size"] * BLOCK)
    peak = peak_flops()
    mfu = f", MFU {100 * flops / (step / 1000) / peak:.1f}%" if peak else ""
    return (
        f"{name}: {per_layer:.1f} ms per decoder layer, {rest:.1f} ms the rest (embedding, output projection and "
        f"loss, optimizer); projected Llama-3-8B step ({EIGHT_B_LAYERS} layers, {params / 1e9:.2f}B parameters, "
        f"{BLOCK} tokens): {step:.0f} ms, {BLOCK / (step / 1000):,.0f} tokens/s{mfu} on this GPU"
    )


def grpo_projection(rows: list[dict]) -> str | None:
    """8B's GRPO step from the 4- and 2-layer GRPO rows: sampling and training each extrapolated per layer (decoding
    reads every layer's weights at every token), scoring as measured (it does not depend on the model)."""
    by = {r["layers"]: r for r in rows if r.get("objective") == "grpo" and r.get("generation_seconds")}
    if 2 not in by or 4 not in by:
        return None
    a, b = by[2], by[4]
    parts = {}
    for key in ("generation_seconds", "training_seconds"):
        per_layer = (b[key] - a[key]) / 2
        if per_layer <= 0 or a[key] - 2 * per_layer < 0:
            return f"GRPO: 4 layers' {key} not above 2 layers' ({b[key]:.2f} vs {a[key]:.2f} s): noise, no projection"
        parts[key] = (per_layer, a[key] - 2 * per_layer)
    (gen_layer, gen_rest), (train_layer, train_rest) = parts["generation_seconds"], parts["training_seconds"]
    generation = gen_rest + EIGHT_B_LAYERS * gen_layer
    training = train_rest + EIGHT_B_LAYERS * train_layer
    step = generation + b["reward_seconds"] + training
    tokens = b["completions"] * b["completion_tokens"]
    return (
        f"GRPO ({b['completions']} completions of {b['completion_tokens']:.0f} tokens a step): sampling "
        f"{1000 * gen_layer:.0f} ms per decoder layer, {1000 * gen_rest:.0f} ms the rest (embedding, output projection "
        f"and sampler at every token, HF's loop); training {1000 * train_layer:.0f} ms per layer, "
        f"{1000 * train_rest:.0f} ms the rest; projected Llama-3-8B step ({EIGHT_B_LAYERS} layers): sampling "
        f"{generation:.1f} s ({tokens / generation:,.0f} tokens/s), training {training:.1f} s, step {step:.1f} s, "
        f"{100 * generation / step:.0f}% of it sampling, on this GPU"
    )


def peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    from anygpu.runtime import hardware

    return hardware.peak_flops(torch.cuda.get_device_name(0), "bf16")


def tflops(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


GRPO_NAMES = {r.name for r in ROWS if r.data == "grpo"}


def _fmt(value, spec: str) -> str:
    """A table cell: the value in `spec`, or – where the row has none."""
    return "–" if value is None else format(value, spec)


def grpo_table(rows: list[dict]) -> list[str]:
    """The GRPO rows' step split: seconds a step, its sampling, scoring and training (the step less both)."""
    lines = [
        "| GRPO | layers | s/step | sampling (s) | rewards (s) | training (s) | completions × mean tokens (prompt + "
        "completion) | sampled tokens/s | tokens/s (step) | tokens/s (training) | peak memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status", "ok") != "ok":
            lines.append(f"| {r['name']} | {r['layers']} | {r['status']} | | | | | | | | |")
            continue
        shape = f"{r['completions']} × ({r['prompt_tokens']:.0f} + {r['completion_tokens']:.0f})"
        lines.append(
            f"| {r['name']} | {r['layers']} | {r['ms_per_step'] / 1000:.2f} | {r['generation_seconds']:.2f} | "
            f"{r['reward_seconds']:.3f} | {r['training_seconds']:.2f} | {shape} | "
            f"{_fmt(r['generated_tokens_per_second'], ',.0f')} | {_fmt(r['tokens_per_second'], ',.0f')} | "
            f"{_fmt(r['training_tokens_per_second'], ',.0f')} | {_fmt(r['peak_memory_gib'], '.1f')} |"
        )
    return lines


def profile_table(rows: list[dict]) -> list[str]:
    """The profiled rows' step by kernel kind (ms), and each one's longest kernels: the step's wall ms less its
    kernels' is the time the GPU idled (kernels on two streams at once can make it negative)."""
    profiled = [r for r in rows if "profile" in r]
    if not profiled:
        return []
    cpu = any(r["profile"].get("device") == "cpu" for r in profiled)
    lines = [
        "Where the profiled step's GPU time goes (ms)"
        + (": the rehearsal, the CPU ops' self time instead of kernels" if cpu else "")
        + " (ms/step: the measured window's; profiled: the step under the profiler)",
        "",
        f"| configuration | layers | ms/step | profiled | kernels | idle | {' | '.join(KIND_NAMES)} |",
        "|---|---|---|---|---|---|" + "---|" * len(KIND_NAMES),
    ]
    tops = []
    for r in profiled:
        p = r["profile"]
        if "error" in p:
            lines.append(f"| {r['name']} | {r['layers']} | {_fmt(r.get('ms_per_step'), '.1f')} | {_cell(p['error'])} |")
            continue
        kinds = " | ".join(_fmt(p["kinds"].get(k), ".1f") for k in KIND_NAMES)
        idle = p["step_ms"] - p["kernel_ms"]
        lines.append(
            f"| {r['name']} | {r['layers']} | {_fmt(r.get('ms_per_step'), '.1f')} | {p['step_ms']:.1f} | "
            f"{p['kernel_ms']:.1f} | {idle:.1f} | {kinds} |"
        )
        top = "; ".join(f"`{name.replace(TICK, QUOTE)}` {ms:.1f} ms × {calls}" for name, ms, calls in p["top"][:5])
        tops.append(f"- {r['name']} ({r['layers']} layers), longest: {top}")
    return [*lines, "", *tops]


TICK, QUOTE = "`", "'"  # a kernel name's backtick (none seen) would end its code span


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell (an error's text can hold a C++ name: templates, operators)."""
    return text.replace("|", "\\|").replace("`", "'").replace("\n", " ")


def table(part: int, path: Path) -> str:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    every = [r for r in recs if r.get("kind") == "row"]
    grpo_rows = [r for r in every if r["name"] in GRPO_NAMES]  # their own table: a step that samples its rows
    rows = [r for r in every if r["name"] not in GRPO_NAMES]
    lines = [
        "| configuration | layers | ms/step | tokens/s | MFU | peak memory (GiB) | host syncs/step | graph breaks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status", "ok") != "ok":
            lines.append(f"| {r['name']} | {r['layers']} | {r['status']} | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['layers']} | {_fmt(r['ms_per_step'], '.1f')} | {_fmt(r['tokens_per_second'], ',.0f')} | "
            f"{'–' if r.get('mfu') is None else format(100 * r['mfu'], '.1f') + '%'} | {_fmt(r['peak_memory_gib'], '.1f')} | "
            f"{_fmt(r['host_syncs_per_step'], 'd')} | {_fmt(r['graph_breaks'], 'd')} |"
        )
    out = [f"### Part {part}", ""] + ([*lines, ""] if rows or not grpo_rows else [])  # ROWS=grpo-…: GRPO's alone
    if profiled := profile_table(rows):
        out += [*profiled, ""]
    if grpo_rows:
        out += [*grpo_table(grpo_rows), ""]
    for name in ("eager", "compiled + FP8 rowwise"):
        if (line := projection(rows, name)) is not None:
            out.append(f"- {line}")
    if (line := grpo_projection(grpo_rows)) is not None:
        out.append(f"- {line}")
    elif any(r.get("objective") == "grpo" for r in grpo_rows):
        out.append("- GRPO: no per-layer cost (it needs both the 4- and the 2-layer GRPO rows)")
    for r in recs:
        if r.get("kind") == "gemm":
            out.append(
                f"- matmul ceiling at {r['n']}³: bf16 {tflops(r['bf16_tflops'])} TFLOP/s; FP8 tensorwise "
                f"{tflops(r.get('fp8_tensorwise_tflops'))}, rowwise {tflops(r.get('fp8_rowwise_tflops'))} TFLOP/s"
            )
        if r.get("kind") == "cp":
            cells = ", ".join(f"{k['kind']} C={k['cp']}: {_fmt(k.get('ms'), '.1f')} ms" for k in r["kernels"])
            out.append(f"- attention at {r['kernels'][0]['tokens']:,} tokens, forward + backward per rank: {cells}")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("plan", "prepare", "row", "gemm", "cp", "facts", "table"))
    p.add_argument("arg", nargs="*")
    p.add_argument("--part", type=int)
    p.add_argument("--lines", action="store_true", help="plan: id|name|layers|seconds|main or late, per row")
    p.add_argument("--commands", action="store_true", help="plan: each row's engine command")
    a = p.parse_args()
    if a.what == "plan":
        rows = [r for r in ROWS if a.part in (None, r.part)]
        if a.lines:  # for gpu_lease.sh
            print("\n".join(f"{r.id}|{r.name}|{r.layers}|{r.seconds}|{'late' if r.late else 'main'}" for r in rows))
        elif a.commands:
            print("\n".join(f"  {r.id}: run_fsdp_standalone.py {' '.join(engine_argv(r))}" for r in rows))
        else:
            print(json.dumps([{**asdict(r), "id": r.id, "argv": engine_argv(r)} for r in rows], indent=1))
    elif a.what == "prepare":
        prepare()
    elif a.what == "row":
        prepare()  # done by the part already: a row run alone prepares what it reads
        print("LEASE_ROW " + json.dumps({"kind": "row", **run_row(row_by_id(a.arg[0]))}), flush=True)
    elif a.what == "gemm":
        print("LEASE_GEMM " + json.dumps({"kind": "gemm", **gemm()}), flush=True)
    elif a.what == "cp":
        print("LEASE_CP " + json.dumps({"kind": "cp", "kernels": cp_kernels()}), flush=True)
    elif a.what == "facts":
        print(facts())
    elif a.what == "table":
        print(table(int(a.arg[0]), Path(a.arg[1])), end="")


if __name__ == "__main__":
    main()
