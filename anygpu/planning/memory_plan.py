"""Per-GPU memory of a training run, before it starts: model states exact, activations estimated.

Model states come from the model's real parameter shapes (built on the meta device, nothing
allocated) and what each strategy keeps where:

  bytes per parameter        parameters  gradients  optimizer (AdamW m, v [+ fp32 master])
  fp32, any strategy         4           4          8                      = 16
  bf16, DDP / FSDP2          4 (master)  4          8   (bf16 only in compute) = 16
  bf16, ZeRO-2 / ZeRO-3      2           2          12  (fp32 master + m + v) = 16

Low-bit AdamW (`--optim adamw_torch_8bit` / `adamw_torch_4bit`, DDP and FSDP2 only: DeepSpeed's flat partitions
cannot hold its row blocks) stores each moment in 1 or 0.5 bytes plus an fp32 scale per block of a row: ~2.03 or
~1.06 bytes of optimizer state per parameter instead of 8 (`anygpu.config.optimizers.state_bytes`).

Each is divided by N where the strategy shards: FSDP2 splits each parameter on dim 0 (rank r holds rows
[r·⌈d0/N⌉, (r+1)·⌈d0/N⌉)), exactly as `fully_shard` does; DeepSpeed partitions the flattened
parameters evenly. HSDP (the FSDP2 engine's --dp_replicate R --dp_shard S) is FSDP2 within each
replica group: N is S, not the world size R·S. CPU offload moves the sharded states to CPU RAM. LoRA: the frozen
base keeps only its parameters (4 bytes in fp32, 2 in bf16: both engines hold it in bf16 under --bf16, see
`lora.hold_frozen_in`), the adapters are trained like full parameters.

Activations (an estimate) follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"), adapted to a Llama-style block's real shapes: the tensors autograd
saves per token of one layer are the two RMSNorm inputs (upcast to fp32 by HF), the q/k/v inputs
and outputs (GQA: k and v have num_key_value_heads·head_dim), the attention output, and SwiGLU's
gate, up, SiLU(gate) and product (4·intermediate); attention itself is a fused SDPA kernel (no
s² scores). The model's own loss keeps the logits in the compute dtype, upcast to fp32 and
log-softmaxed in fp32; the lean loss (the engines' default, `anygpu.model.lean_loss`) keeps the
final hidden states' gradient instead, and one chunk's logits (`LEAN_CHUNK_BYTES` of fp32) at a time.
With activation checkpointing each layer keeps only its input, and one layer is recomputed at a time; with
selective checkpointing (the FSDP2 engine's `--gradient_checkpointing_policy selective`) each layer keeps its input
and the outputs of its matrix multiplications and attention (q, k, v, the attention output, o_proj's, gate's, up's
and down's), and one layer's elementwise rest is recomputed at a time.

--objective grpo (`Generation`, the native engine's FSDP2 and HSDP only) adds a round's generation, which holds,
beside the sharded parameters and AdamW state (the gradients are freed at each step's end), the whole model gathered
in the compute dtype on every rank (`gathered_model_bytes`: `anygpu.train.generation.gathered`), the KV cache of
this rank's G/W completions generated in one batch (`kv_cache_bytes`), and the prefill's and the sampler's working
tensors (`generation_working_bytes`): a row's peak is the larger of its training step and its generation. Its
training rows are prompt + completion tokens long and make the logits of the completion's positions only (no lean
loss: `grpo_logit_bytes`); β > 0 adds a frozen reference sharded like the policy (none with LoRA: its base is the
reference). With --use_vllm a colocated vLLM engine generates instead: it holds its share of the GPU
(`vllm_bytes`: its own weights and KV cache) through training too, and a row fits only where that share holds the
whole model in the compute dtype (`vllm_weights_fit`); the policy gathers nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from anygpu.config import nf4
from anygpu.config.optimizers import FP32, LOW_BIT, state_bytes
from anygpu.runtime.mesh import fsdp_rows

STRATEGIES = ("ddp", "fsdp2", "fsdp2_offload", "zero2", "zero2_offload", "zero3", "zero3_offload")
ACCELERATE_CONFIG = {
    "ddp": "ddp",
    "fsdp2": "fsdp",
    "fsdp2_offload": "fsdp_offload",
    "zero2": "deepspeed_zero2",
    "zero2_offload": "deepspeed_zero2 with offload_optimizer_device: cpu",
    "zero3": "deepspeed_zero3",
    "zero3_offload": "deepspeed_zero3_offload",
}
# Memory the framework holds besides tensors (CUDA/HIP context, allocator slack, kernels' workspaces).
RESERVED_BYTES = 1 * 2**30
SAFETY = 0.90  # plan to use at most 90% of a GPU's memory
GIB = 2**30
# The FSDP2 engine's HSDP: its rows exist only where the shard group is smaller than the job (make_plan's dp_shard).
HSDP = "hsdp"
DPO_STRATEGIES = ("ddp", "zero2", "zero3", "fsdp2", HSDP)  # --objective dpo: not under offload
GRPO_STRATEGIES = ("fsdp2", HSDP)  # --objective grpo: the native engine's, not under offload (refused there)
# --objective grpo's sampler, per row and vocabulary entry, at each new token: the logits in the compute dtype and
# their fp32 copy, the warpers' fp32 copies, the keyed noise's int64 words (splitmix64's temporaries) and its fp32
# uniforms and Gumbel values (`anygpu.train.generation.KeyedSampler`): an estimate, a few tensors of (B, V)
SAMPLER_BYTES_PER_LOGIT = 48


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    four_bit: bool = False  # QLoRA's base: held in NF4 (`anygpu.config.nf4`)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Generation:
    """--objective grpo's rounds: G completions a step (`global_batch_size`, counted in completions), each rank
    generating its G/W in one batch; rows of at most `prompt_length` + `completion_length` tokens."""

    global_batch_size: int
    prompt_length: int
    completion_length: int
    num_generations: int = 8
    beta: float = 0.0  # > 0: a reference (`Shapes.reference`, none with LoRA)
    vllm_share: float = 0.0  # --use_vllm: the share of each GPU its vLLM engine holds throughout (0: the policy's own)

    def rows_per_rank(self, machine: Machine) -> int:
        """The completions one rank generates in one batch (G/W: every GPU is a data-parallel rank under grpo)."""
        return max(1, self.global_batch_size // max(1, machine.num_gpus))

    @property
    def row_length(self) -> int:
        return self.prompt_length + self.completion_length


@dataclass(frozen=True)
class Shapes:
    """What the plan needs of a model: its parameters and the block's dimensions."""

    params: tuple[Param, ...]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_param_numel: int  # one decoder layer (the unit FSDP2 / ZeRO-3 gather)
    embedding_numel: int = 0  # the input embedding's weight (an FSDP2 unit of its own unless tied)
    head_numel: int = 0  # the output projection's weight (the lean loss's gradient accumulator is its size)
    # --objective dpo: a micro-batch item is a pair, two sequences in one forward; `reference`: a frozen copy of the
    # model runs beside it (no --precompute_ref_log_probs, and not LoRA, whose reference is its base)
    sequences_per_item: int = 1
    reference: bool = False
    # packed rows (samples concatenated, positions restarting) under an attention that takes a mask (sdpa, eager):
    # transformers builds a dense (T × T) mask of the whole row for them (`attention_mask_bytes`)
    dense_mask: bool = False
    # AdamW's moments: a state kind (`anygpu.config.optimizers.state_kind`): fp32 (8 bytes a parameter), bf16 or low-bit
    optim: str = "adamw_torch"
    # mixtures of experts: the experts' weights of one MoE layer, their count and top-k; `ep`: --ep E (FSDP2 engine),
    # under which a rank gathers only its E-th of them with a layer (`anygpu.runtime.expert_parallel`)
    layer_expert_numel: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0
    ep: int = 1
    # --objective grpo: its rounds' shapes (None: no generation)
    generation: Generation | None = None

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def num_trainable(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def four_bit(self) -> bool:
        return any(p.four_bit for p in self.params)


def shapes_from_model(
    model, config, lora_r: int = 0, lora_targets: tuple[str, ...] = (), load_in_4bit: bool = False
) -> Shapes:
    """Shapes of a (meta) HF causal LM; with ``lora_r`` the base is frozen and the adapter is the one the
    engines train: peft's own LoRA on the meta model (``lora_targets``: module names or all-linear; none:
    peft's default for the model type, as --lora_target_modules left out); ``load_in_4bit``: QLoRA's 4-bit base, the
    weights the engine quantises (`anygpu.model.qlora`)."""
    if lora_r:
        from types import SimpleNamespace

        from anygpu.model import lora

        model = lora.wrap(
            model,
            SimpleNamespace(
                use_peft=True,
                lora_r=lora_r,
                lora_alpha=2 * lora_r,
                lora_dropout=0.0,
                lora_target_modules=list(lora_targets) or None,
                lora_modules_to_save=None,
            ),
        )
    four_bit: set[int] = set()
    if lora_r and load_in_4bit:  # the weights the engine would quantise (by shape: no quantisation on meta here)
        from anygpu.model import qlora

        four_bit = {id(m.weight) for m in qlora.modules(model).values()}
    seen: set[int] = set()
    params: list[Param] = []
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights are one tensor
            continue
        seen.add(id(p))
        params.append(Param(name, tuple(p.shape), trainable=p.requires_grad, four_bit=id(p) in four_bit))
    from anygpu.runtime import expert_parallel
    from anygpu.runtime.blocks import decoder_layers

    layers = decoder_layers(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    experts = expert_parallel.experts_modules(model)
    return Shapes(
        tuple(params),
        config.hidden_size,
        getattr(config, "intermediate_size", 4 * config.hidden_size),
        config.num_hidden_layers,
        heads,
        getattr(config, "num_key_value_heads", None) or heads,
        head_dim,
        config.vocab_size,
        # the largest layer: a MoE family's dense first layers (DeepSeek-V3) are smaller than its MoE layers
        max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0),
        *_embedding_and_head(model),
        layer_expert_numel=sum(p.numel() for p in experts[0].parameters()) if experts else 0,
        num_experts=expert_parallel.num_experts(model),
        experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
        moe_layers=len(experts),
    )


def _embedding_and_head(model) -> tuple[int, int]:
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    numel = lambda m: m.weight.numel() if getattr(m, "weight", None) is not None else 0  # noqa: E731
    return numel(embedding), numel(head)


def _even(numel: int, world: int) -> int:
    """DeepSpeed's flat partition: every rank holds ⌈numel/N⌉ elements (padded)."""
    return -(-numel // world)


# Activation checkpointing in the plan: False (none), True (full) or SELECTIVE (the FSDP2 engine's per-op policy).
SELECTIVE = "selective"
# The strategies whose rows include selective checkpointing: the FSDP2 engine's (its plain FSDP2 and HSDP).
SELECTIVE_STRATEGIES = ("fsdp2",)


@dataclass
class Row:
    strategy: str
    precision: str  # fp32 | bf16
    activation_checkpointing: bool | str  # False, True (full) or SELECTIVE
    lora: bool
    micro_batch: int
    per_gpu_bytes: dict[str, int]  # parameters, gradients, optimizer, activations, transient, reserved
    cpu_bytes: int
    fits: bool
    accelerate_config: str
    activations_are_estimates: bool = True
    host_bytes: dict[str, int] = field(default_factory=dict)  # node 0's host RAM: loading, exporting (`host_bytes`)
    # --objective grpo: what a round's generation holds beside the sharded state (gathered, kv_cache, working)
    generation_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def training_peak(self) -> int:
        return sum(self.per_gpu_bytes.values())

    @property
    def generation_peak(self) -> int:
        """--objective grpo: the sharded parameters, AdamW state, reference and reserve (no gradients: freed at each
        step's end) with the generation's own bytes; 0 without generation."""
        if not self.generation_bytes:
            return 0
        kept = ("parameters", "optimizer", "reference", "reserved")
        return sum(self.per_gpu_bytes.get(k, 0) for k in kept) + sum(self.generation_bytes.values())

    @property
    def total(self) -> int:
        """The row's peak: its training step's, or under grpo the larger of that and its generation's."""
        return max(self.training_peak, self.generation_peak)

    def to_json(self) -> dict:
        out = {**asdict(self), "total_bytes": self.total}
        if self.generation_bytes:
            out.update(training_peak_bytes=self.training_peak, generation_peak_bytes=self.generation_peak)
        return out


def model_state_bytes(
    shapes: Shapes, strategy: str, precision: str, world: int, rank: int = 0
) -> tuple[dict[str, int], int]:
    """(GPU bytes of parameters, gradients, optimizer on ``rank``; CPU bytes) for one strategy. ``world``: the ranks
    the state is sharded over (for HSDP the shard group S, ``rank`` the rank within it)."""
    if strategy not in (*STRATEGIES, HSDP):
        raise ValueError(f"strategy {strategy!r} is unknown: use one of {', '.join(STRATEGIES)}, {HSDP}")
    bf16 = precision == "bf16"
    zero = strategy.startswith("zero")
    fsdp = strategy.startswith(("fsdp2", HSDP))  # HSDP is FSDP2 within a replica group
    sharded_params = fsdp or strategy.startswith("zero3")
    sharded_grads = strategy != "ddp"

    def held(p: Param, shard: bool) -> int:
        if not shard:
            return p.numel
        return fsdp_rows(p.shape, world, rank) if fsdp else _even(p.numel, world)

    frozen_bytes = 2 if bf16 else 4
    pbytes = 2 if (bf16 and zero) else 4  # DeepSpeed keeps bf16 weights; FSDP2/DDP keep fp32 masters
    gbytes = pbytes
    obytes = 12 if (bf16 and zero) else 8
    params = grads = optim = 0
    for p in shapes.params:
        if p.four_bit:  # QLoRA's base: rows that split at whole scale blocks sharded, the others whole
            params += nf4.nbytes(nf4.held_elements(p.shape, world) if sharded_params else p.numel, frozen_bytes)
            continue
        if not p.trainable:
            params += held(p, sharded_params) * frozen_bytes
            continue
        params += held(p, sharded_params) * pbytes
        grads += held(p, sharded_grads) * gbytes
        # DeepSpeed's flat partitions: AdamW's fp32 state; FSDP2/DDP: whole rows, so their blocks and scales
        optim += held(p, sharded_grads) * obytes if zero else state_bytes(p.shape, held(p, sharded_grads), shapes.optim)
    cpu = 0
    if strategy.endswith("offload"):
        if strategy == "zero2_offload":  # ZeRO-Offload: optimizer (and its gradient partition) on CPU
            cpu, grads, optim = grads + optim, 0, 0
        else:  # FSDP2 CPUOffloadPolicy / ZeRO-3 offload_param+optimizer: every sharded state on CPU
            cpu, params, grads, optim = params + grads + optim, 0, 0, 0
    return {"parameters": params, "gradients": grads, "optimizer": optim}, cpu


def reference_bytes(shapes: Shapes, strategy: str, precision: str, world: int, rank: int = 0) -> int:
    """--objective dpo's frozen reference: every parameter in the compute dtype (2 bytes in bf16, 4 in fp32), no
    gradient, no optimizer state, sharded as the strategy shards parameters (on the CPU under offload)."""
    if strategy.endswith("offload"):
        return 0
    e = 2 if precision == "bf16" else 4
    # under ZeRO-3 too FSDP2 shards it (engines/trunk/reference_model)
    if strategy.startswith(("fsdp2", HSDP, "zero3")):
        return e * sum(fsdp_rows(p.shape, world, rank) for p in shapes.params)
    return e * shapes.num_params


# anygpu.model.lean_loss.GPU_CHUNK_BYTES: plans are for GPUs (this module stays free of torch)
LEAN_CHUNK_BYTES = 1 << 30


def activation_bytes(
    shapes: Shapes,
    micro_batch: int,
    block_size: int,
    precision: str,
    checkpointing: bool | str,
    lean_loss: bool = True,
) -> int:
    """Saved activations of one micro-batch (an estimate; see the module docstring). `checkpointing`: False, True
    (full) or SELECTIVE."""
    e = 2 if precision == "bf16" else 4
    h, i, v = shapes.hidden_size, shapes.intermediate_size, shapes.vocab_size
    q = shapes.num_heads * shapes.head_dim
    kv = shapes.num_kv_heads * shapes.head_dim
    layer = (
        e * (h + q + 2 * kv + q + h + 4 * i)  # norm outs, q/k/v, attention out, norm out, SwiGLU
        + 2 * 4 * h
    )  # both RMSNorms' inputs upcast to fp32
    kept = {
        False: layer,
        True: e * h,  # the layer's input
        SELECTIVE: e * (h + q + 2 * kv + q + h + 2 * i + h),  # input, q/k/v, attention, o_proj, gate/up, down outputs
    }[checkpointing]
    tokens = micro_batch * block_size
    per_token = shapes.num_layers * kept + (layer if checkpointing else 0)  # one layer recomputed at a time
    if shapes.generation is not None:  # grpo: embedding out, final norm; the completions' logits only
        return tokens * (per_token + e * h + 4 * h) + grpo_logit_bytes(shapes, micro_batch, precision)
    if lean_loss:  # embedding out, final norm, the hidden states' gradient; one chunk's logits at a time
        chunk = min(tokens, max(1, LEAN_CHUNK_BYTES // (4 * v)))
        return tokens * (per_token + e * h + 4 * h + e * h) + chunk * v * (e + 4 + 4)
    # embedding out, final norm, logits: dtype, fp32 copy, log-softmax
    return tokens * (per_token + e * h + 4 * h + v * (e + 4 + 4))


def grpo_logit_bytes(shapes: Shapes, micro_batch: int, precision: str) -> int:
    """--objective grpo's log-probs (`anygpu.train.rollout.token_log_probs`) of a micro-batch of completions (an
    estimate): the logits of the completion's positions only (max_completion_length + 1 of a row), in the compute
    dtype, their fp32 copy over the temperature (kept for the backward), and two more fp32 tensors of that size at
    the peak (logsumexp's shifted exponentials in the forward, the logits' gradients in the backward); the
    entropies are taken a row at a time (not counted)."""
    e = 2 if precision == "bf16" else 4
    positions = micro_batch * (shapes.generation.completion_length + 1)
    return positions * shapes.vocab_size * (e + 3 * 4)


def gathered_model_bytes(shapes: Shapes, strategy: str, precision: str, world: int) -> int:
    """--objective grpo: the whole model gathered for a round's generation, on every rank, in the compute dtype
    (FSDP2 all-gathers bf16 under --bf16; a 4-bit base stays NF4). Nothing where FSDP2 does not shard: one rank in
    fp32 (`anygpu.runtime.parallel.needs_sharding`), whose model is whole already."""
    bf16 = precision == "bf16"
    if not (world > 1 or bf16 or strategy == HSDP):
        return 0
    e = 2 if bf16 else 4
    return sum(nf4.nbytes(p.numel, e) if p.four_bit else p.numel * e for p in shapes.params)


def kv_cache_bytes(shapes: Shapes, rows: int, length: int, precision: str) -> int:
    """The KV cache of `rows` completions generated in one batch, each `length` tokens (prompt + completion): K and
    V of every layer, num_key_value_heads × head_dim per token, in the compute dtype."""
    e = 2 if precision == "bf16" else 4
    return 2 * shapes.num_layers * shapes.num_kv_heads * shapes.head_dim * e * rows * length


def generation_working_bytes(shapes: Shapes, rows: int, prompt_length: int, precision: str) -> int:
    """An estimate of generation's working tensors beside the weights and the cache: the prefill's one layer at a
    time over every prompt token of the batch (no gradient: hidden states, q/k/v, attention out, SwiGLU's gate, up
    and their product), and the sampler's few (B, V) tensors (`SAMPLER_BYTES_PER_LOGIT`)."""
    e = 2 if precision == "bf16" else 4
    h, i = shapes.hidden_size, shapes.intermediate_size
    q, kv = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    prefill = rows * prompt_length * e * (2 * h + q + 2 * kv + 3 * i)
    return prefill + rows * shapes.vocab_size * SAMPLER_BYTES_PER_LOGIT


def generation_bytes(shapes: Shapes, machine: Machine, strategy: str, precision: str, world: int) -> dict[str, int]:
    """--objective grpo: what a round's generation holds on a rank beside its sharded state ({} without)."""
    gen = shapes.generation
    if gen is None or gen.vllm_share:  # vLLM's engine: its share, held throughout (`vllm_bytes`), no gathered copy
        return {}
    rows = gen.rows_per_rank(machine)
    return {
        "gathered": gathered_model_bytes(shapes, strategy, precision, world),
        "kv_cache": kv_cache_bytes(shapes, rows, gen.row_length, precision),
        "working": generation_working_bytes(shapes, rows, gen.prompt_length, precision),
    }


def vllm_bytes(shapes: Shapes, machine: Machine) -> int:
    """--use_vllm: what each GPU's colocated vLLM engine holds for the whole run (its weights and KV cache)."""
    gen = shapes.generation
    return int(gen.vllm_share * machine.gpu_memory_bytes) if gen is not None and gen.vllm_share else 0


def vllm_weights_fit(shapes: Shapes, machine: Machine, precision: str) -> bool:
    """--use_vllm: whether the engine's share holds the whole model in the compute dtype and one completion's cache."""
    gen = shapes.generation
    if gen is None or not gen.vllm_share:
        return True
    weights = gathered_model_bytes(shapes, "fsdp2", precision, 2)
    return weights + kv_cache_bytes(shapes, 1, gen.row_length, precision) <= vllm_bytes(shapes, machine)


def transient_bytes(shapes: Shapes, strategy: str, precision: str, world: int, lean_loss: bool = True) -> int:
    """Unsharded working copies: gathered units (FSDP2/ZeRO-3: this one and the prefetched next, plus their
    unsharded gradients before the reduce-scatter; the largest unit: a decoder layer, or at a large vocabulary the
    embedding or the output projection, FSDP2 units of their own), autocast's bf16 weights (DDP); and the lean
    loss's gradient of the output projection (`lean_head_bytes`).

    No gradient accumulation buffer: under FSDP2 every micro-batch's gradients are reduce-scattered into the
    sharded gradient at once (HSDP defers only the all-reduce across replica groups), DDP and one process sum
    into the (counted) gradients, DeepSpeed reduces each micro-batch into its partitions."""
    e = 2 if precision == "bf16" else 4
    lean = lean_head_bytes(shapes, precision) if lean_loss else 0
    if strategy.startswith(("fsdp2", "zero3", HSDP)) and (world > 1 or strategy.endswith("offload")):
        unit = max(gathered_layer_numel(shapes), shapes.embedding_numel, shapes.head_numel)
        return 2 * unit * (e + e) + lean
    if strategy == "ddp" and precision == "bf16":
        return shapes.num_params * 2 + lean  # autocast's bf16 copies of the weights (ZeRO-2 keeps bf16 weights itself)
    return lean


def gathered_layer_numel(shapes: Shapes) -> int:
    """The elements FSDP2 gathers for the largest decoder layer: all of it, or under --ep E its dense part and its
    E-th of the experts."""
    return shapes.layer_param_numel - shapes.layer_expert_numel * (shapes.ep - 1) // shapes.ep


def all_to_all_bytes(shapes: Shapes, tokens: int, precision: str) -> int:
    """--ep: what one rank sends per optimizer step for `tokens` of its tokens: each token's hidden state to its top-k
    experts and back, in the forward and again in the backward, at every MoE layer (balanced routing; (E-1)/E of it
    leaves the rank)."""
    if shapes.ep == 1 or not shapes.layer_expert_numel:
        return 0
    e = 2 if precision == "bf16" else 4
    per_layer = tokens * shapes.experts_per_token * shapes.hidden_size * e * 4
    return per_layer * shapes.moe_layers * (shapes.ep - 1) // shapes.ep


def attention_mask_bytes(shapes: Shapes, rows: int, block_size: int, precision: str, cp: int = 1) -> int:
    """`rows` packed rows in one forward under sdpa or eager attention: the boolean mask transformers builds for each
    whole row (T × T, once per forward), and the copy in the compute dtype that sdpa makes of a boolean mask at each
    layer's call. Under context parallelism Ulysses (C divides the heads) still takes every row's whole mask; the
    gathered keys and values (C does not) build a rank's T/C query rows of it only. 0 for rows that need no mask
    (raw-text blocks, one sample per row: sdpa's causal path) and for flash attention, which takes the samples'
    boundaries."""
    if not shapes.dense_mask:
        return 0
    e = 2 if precision == "bf16" else 4
    gathered = cp > 1 and (shapes.num_heads % cp or shapes.num_kv_heads % cp)
    queries = block_size // cp if gathered else block_size
    return rows * queries * block_size * (1 + e)


def lean_head_bytes(shapes: Shapes, precision: str) -> int:
    """The lean loss (`anygpu.model.lean_loss`) sums the output projection's weight gradient over its chunks in fp32
    during the forward and keeps it (in the weight's dtype: a second copy under bf16) for the backward's start."""
    return shapes.head_numel * (4 + (2 if precision == "bf16" else 0))


@dataclass
class Machine:
    num_gpus: int
    gpu_memory_bytes: int  # per GPU; 0: no GPU (the plan is then for CPU processes)
    gpu_name: str = ""
    peak_flops: float | None = None  # dense bf16 per GPU
    source: str = "given"
    num_nodes: int = 1
    host_memory_bytes: int = 0  # per node; 0: not known (offloaded rows are then not refused for it)

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.num_gpus // max(1, self.num_nodes))


@dataclass
class PlanResult:
    shapes: Shapes
    machine: Machine
    block_size: int
    global_batch_size: int
    rows: list[Row] = field(default_factory=list)
    recommended: Row | None = None
    gradient_accumulation_steps: int | None = None
    step_seconds: float | None = None
    offload_seconds: float = 0.0  # of step_seconds: what offload adds (`offload_seconds`)
    mfu: float = 0.4
    flops_per_token: float = 0.0
    notes: list[str] = field(default_factory=list)
    dp_shard: int | None = None  # HSDP's shard group, where it has rows
    cp_advice: tuple[int, Row] | None = None  # nothing fits without offload: the smallest --cp that does
    low_bit_advice: tuple[str, Row] | None = None  # the same, with low-bit AdamW (`low_bit_advice`)
    cp: int = 1  # the plan's context parallelism (the global batch is split over the GPUs / C)


def cp_advice(shapes: Shapes, machine: Machine, block_size: int, lora: bool = False) -> tuple[int, Row] | None:
    """The smallest context parallelism C (dividing the GPUs, the attention and KV heads and the block) at
    which the FSDP2 engine, bf16 with activation checkpointing, fits a micro-batch of one sequence."""
    for c in divisors(max(1, machine.num_gpus))[1:]:
        if shapes.num_heads % c or shapes.num_kv_heads % c or block_size % c:
            continue
        row = row_for(shapes, machine, "fsdp2", "bf16", True, lora, 1, block_size, cp=c)
        if row.fits:
            return c, row
    return None


def replan(result: PlanResult, shapes: Shapes, lora: bool, mfu: float, flops_per_token: float) -> PlanResult:
    """The plan of `result`'s machine, block, batch and mesh for other shapes (another optimizer, no mask)."""
    return make_plan(
        shapes,
        result.machine,
        result.block_size,
        result.global_batch_size,
        lora=lora,
        mfu=mfu,
        flops_per_token=flops_per_token,
        dp_shard=result.dp_shard,
        cp=result.cp,
    )


def low_bit_advice(result: PlanResult, lora: bool, mfu: float, flops_per_token: float) -> tuple[str, Row] | None:
    """Offload, or nothing, is recommended with AdamW's fp32 moments: the first low-bit --optim whose plan fits
    without offload, and its recommended row."""
    for optim in LOW_BIT:
        alt = replan(result, replace(result.shapes, optim=optim), lora, mfu, flops_per_token)
        if alt.recommended is not None and not alt.recommended.cpu_bytes:
            return optim, alt.recommended
    return None


def mask_note(result: PlanResult, unmasked: Shapes, lora: bool, mfu: float, flops_per_token: float) -> None:
    """Packed rows' dense mask is a large part of a GPU, or what keeps the job from fitting: say so, and what the
    plan recommends without it (flash attention, or one sample per row)."""
    machine, block = result.machine, result.block_size
    mask = attention_mask_bytes(result.shapes, result.shapes.sequences_per_item, block, "bf16", result.cp)
    if result.recommended is not None and mask < 0.1 * machine.gpu_memory_bytes:
        return
    alt = replan(result, unmasked, lora, mfu, flops_per_token)
    if alt.recommended is not None:
        instead = f"the plan recommends {alt.recommended.strategy} ({alt.recommended.accelerate_config})"
    elif alt.cp_advice is not None:
        instead = f"--cp {alt.cp_advice[0]} fits"
    else:
        instead = "nothing fits either"
    shapes, cp = result.shapes, result.cp
    flash = cp == 1 or not (shapes.num_heads % cp or shapes.num_kv_heads % cp)  # gathered K/V need a mask
    ways = (
        "--attn_implementation varlen_attention (or flash_attention_2) takes the samples' boundaries instead of a mask, or "
        * flash
    )
    result.notes.append(
        f"note: packed rows under sdpa/eager attention build a dense {block} × {block} mask per forward "
        f"({mask / GIB:.2f} GiB per micro-batch item in bf16, counted in other; under --cp every rank holds the whole "
        f"row's). Without it ({instead}): {ways}--packing false (one sample per row)."
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hsdp_command(num_gpus: int, dp_shard: int) -> str:
    return f"run_fsdp_standalone.py --dp_replicate {num_gpus // dp_shard} --dp_shard {dp_shard}"


def row_for(
    shapes: Shapes,
    machine: Machine,
    strategy: str,
    precision: str,
    checkpointing: bool,
    lora: bool,
    micro_batch: int,
    block_size: int,
    dp_shard: int | None = None,
    lean_loss: bool = True,
    cp: int = 1,
) -> Row:
    """One strategy's per-GPU bytes; `dp_shard`: HSDP's shard group (the ranks its state is divided by); `cp`:
    the FSDP2 engine's context parallelism (a rank holds the activations of block_size / C tokens)."""
    world = max(1, machine.num_gpus)  # no GPU detected: the plan of one process
    shards = (dp_shard or world) if strategy == HSDP else world
    lean_loss = lean_loss and shapes.generation is None  # grpo: the engine keeps the completions' logits instead
    states, cpu = model_state_bytes(shapes, strategy, precision, shards)
    acts = activation_bytes(
        shapes, micro_batch * shapes.sequences_per_item, block_size // cp, precision, checkpointing, lean_loss
    )
    if shapes.reference:
        states["reference"] = reference_bytes(shapes, strategy, precision, shards)
    per_gpu = {
        **states,
        "activations": acts,
        "transient": transient_bytes(shapes, strategy, precision, shards, lean_loss),
        "reserved": RESERVED_BYTES if machine.gpu_memory_bytes else 0,
    }
    if vllm_bytes(shapes, machine):
        per_gpu["vllm"] = vllm_bytes(shapes, machine)
    if shapes.dense_mask:
        per_gpu["attention_mask"] = attention_mask_bytes(
            shapes, micro_batch * shapes.sequences_per_item, block_size, precision, cp
        )
    budget = machine.gpu_memory_bytes * SAFETY
    host = host_bytes(shapes, strategy, dp_shard or world)
    if cpu:
        host["offloaded"] = cpu * machine.gpus_per_node
    generating = generation_bytes(shapes, machine, strategy, precision, shards)
    how = hsdp_command(world, shards) if strategy == HSDP else ACCELERATE_CONFIG[strategy]
    if cp > 1:
        how = f"run_fsdp_standalone.py --cp {cp}" + " --bf16 true" * (precision == "bf16")
        how += " --gradient_checkpointing true" * (checkpointing is True)
    elif shapes.generation is not None:  # --objective grpo: the native engine's alone
        how = (how if strategy == HSDP else "run_fsdp_standalone.py") + " --bf16 true" * (precision == "bf16")
        how += " --gradient_checkpointing true" * (checkpointing is True)
    if checkpointing == SELECTIVE:  # the FSDP2 engine's only
        how = how if how.startswith("run_fsdp_standalone.py") else "run_fsdp_standalone.py"
        how += " --gradient_checkpointing_policy selective"
    row = Row(
        strategy, precision, checkpointing, lora, micro_batch, per_gpu, cpu, False, how, host_bytes=host,
        generation_bytes=generating,
    )  # fmt: skip
    row.fits = bool(machine.gpu_memory_bytes) and row.total <= budget and fits_host(host, machine)
    row.fits = row.fits and vllm_weights_fit(shapes, machine, precision)
    return row


def fits_host(host: dict[str, int], machine: Machine) -> bool:
    """Whether a node's offloaded state fits its host memory (with the GPUs' safety margin), where it is known."""
    return not machine.host_memory_bytes or host.get("offloaded", 0) <= machine.host_memory_bytes * SAFETY


# Offload's cost. The CPU optimizer step: torch's fused CPU AdamW streams each fp32 parameter, gradient and both
# moments in (16 bytes) and the parameter and moments out (12), bound by the node's memory bandwidth, which its
# ranks share. The copies: each micro-batch copies every parameter shard to the GPU for the forward's and the
# backward's all-gathers (fp32) and each gradient shard back (fp32), over PCIe, hidden behind the compute as far
# as it lasts (FSDP2 prefetches the next unit; ZeRO-2 offload copies the gradient partition down and the bf16
# weights up once a step).
CPU_ADAMW_BYTES_PER_PARAM = 28
HOST_BANDWIDTH = 300e9  # bytes/s per node: a two-socket DDR5 server's sustained ~300-600 GB/s, the low end
PCIE_BANDWIDTH = (
    25e9  # bytes/s per GPU each way: PCIe Gen5 x16's ~50 GB/s pinned, halved for the node's GPUs sharing it
)


def offload_seconds(shapes: Shapes, row: Row, machine: Machine, compute: float, accumulation: int) -> float:
    """Seconds a step adds under offload (0 without): the CPU optimizer step, and the host-GPU copies that
    `compute` seconds of the step's compute do not hide."""
    if not row.cpu_bytes:
        return 0.0
    n = max(1, machine.num_gpus)
    trainable = sum(p.numel for p in shapes.params if p.trainable)
    cpu_step = trainable * machine.gpus_per_node / n * CPU_ADAMW_BYTES_PER_PARAM / HOST_BANDWIDTH
    if row.strategy == "zero2_offload":
        copied = trainable / n * (2 + 2)
    else:
        copied = accumulation * (shapes.num_params / n * 2 * 4 + trainable / n * 4)
    return cpu_step + max(0.0, copied / PCIE_BANDWIDTH - compute)


def compute_seconds(result: PlanResult, row: Row | None = None) -> float | None:
    """A step's compute at the plan's MFU (None without FLOP counts): full checkpointing adds one forward;
    selective recomputes only elementwise ops; fp32 (TF32) runs at about half of bf16's peak. Without a row:
    bf16 without recomputation (what the compute alone takes where nothing fits)."""
    machine = result.machine
    if not result.flops_per_token or not machine.peak_flops:
        return None
    recompute = 4 / 3 if row is not None and row.activation_checkpointing is True else 1.0
    peak = machine.peak_flops * (1 if row is None or row.precision == "bf16" else 0.5)
    tokens = result.global_batch_size * result.block_size
    return tokens * result.flops_per_token * recompute / (max(1, machine.num_gpus) * peak * result.mfu)


def step_seconds(result: PlanResult, row: Row, accumulation: int) -> tuple[float, float] | None:
    """(the step's estimated seconds, offload's part of them), or None without FLOP counts."""
    compute = compute_seconds(result, row)
    if compute is None:
        return None
    extra = offload_seconds(result.shapes, row, result.machine, compute, accumulation)
    return compute + extra, extra


def host_bytes(shapes: Shapes, strategy: str, gpus_per_node: int) -> dict[str, int]:
    """Host RAM on node 0 (the busiest) beyond the strategy's own CPU state, in fp32 (4 bytes per parameter):
    - loading (pretrained or initialised): DDP and ZeRO-1/2 build the whole model in every process; accelerate's
      FSDP2 (`fsdp_cpu_ram_efficient_loading`) in rank 0 only, the others on the meta device; ZeRO-3 (`zero3_init_flag`)
      partitions while building, rank 0 reading the files (the whole model, at worst); the native engine (its FSDP2
      and HSDP rows) reads one tensor at a time in every process and keeps its shards — QLoRA's only engine;
    - exporting: the whole model gathered on rank 0 (`anygpu.checkpoint.export`); a LoRA run's export is its adapter
      (the whole model again only to merge it, `merging`)."""
    whole = 4 * shapes.num_params
    largest = 4 * max((p.numel for p in shapes.params), default=0)
    if strategy in ("ddp", "zero2", "zero2_offload"):
        loading = gpus_per_node * whole
    elif strategy == HSDP or shapes.four_bit:
        loading = gpus_per_node * largest
    else:
        loading = whole
    if shapes.num_trainable < shapes.num_params:
        return {"loading": loading, "exporting": 4 * shapes.num_trainable, "merging": whole}
    return {"loading": loading, "exporting": whole}


# Fastest first: no sharding, then sharding without and with offload (ZeRO-2 before 3: fewer gathers). HSDP
# (when asked for) before FSDP2: only its gradient all-reduce crosses the replica groups (nodes).
PREFERENCE = ("ddp", HSDP, "fsdp2", "zero2", "zero3", "zero2_offload", "fsdp2_offload", "zero3_offload")


def _recommend(
    result: PlanResult, strategies: tuple[str, ...], precisions: tuple[str, ...], lora: bool, share: int, cp: int
) -> None:
    """Into `result`: the quickest (estimated step time) of the strategies that fit, each at the largest micro-batch
    dividing `share` (the sequences of a data-parallel rank); bf16 before fp32; equal estimates (no step time
    without FLOP counts) go to the earlier in order: without checkpointing first, then `PREFERENCE`."""
    shapes, machine, block_size, dp_shard = result.shapes, result.machine, result.block_size, result.dp_shard
    for precision in precisions:
        candidates = []
        for ckpt in (False, SELECTIVE, True):  # the least recomputation first
            for strategy in (s for s in PREFERENCE if s in strategies and has_policy(s, ckpt, cp)):
                fitting = [
                    r
                    for m in reversed(divisors(share))
                    if (
                        r := row_for(shapes, machine, strategy, precision, ckpt, lora, m, block_size, dp_shard, cp=cp)
                    ).fits
                ]
                if fitting:
                    timed = step_seconds(result, fitting[0], share // fitting[0].micro_batch)
                    candidates.append((timed[0] if timed else 0.0, len(candidates), fitting[0]))
        if candidates:
            rec = min(candidates)[2]
            result.recommended = rec
            result.gradient_accumulation_steps = share // rec.micro_batch
            return


def has_policy(strategy: str, checkpointing: bool | str, cp: int = 1) -> bool:
    """Whether `strategy` can checkpoint this way: selective checkpointing is the FSDP2 engine's (plain FSDP2, HSDP,
    context parallelism)."""
    return checkpointing != SELECTIVE or cp > 1 or strategy in (*SELECTIVE_STRATEGIES, HSDP)


def strategies_for(shapes: Shapes, hsdp: bool, cp: int) -> tuple[str, ...]:
    """The strategies that can run this job: HSDP where the shard group is smaller than the job, the FSDP2 engine's
    alone under context parallelism, a 4-bit base or --objective grpo, no DeepSpeed with low-bit optimizer state."""
    strategies = (*STRATEGIES, HSDP) if hsdp else STRATEGIES
    strategies = strategies if cp == 1 else ("fsdp2",)
    if shapes.sequences_per_item > 1:  # --objective dpo: DDP, ZeRO-2, ZeRO-3, FSDP2 and HSDP (not under offload)
        strategies = tuple(s for s in strategies if s in DPO_STRATEGIES)
    if shapes.generation is not None:  # --objective grpo: the native engine's FSDP2 and HSDP, without offload
        strategies = tuple(s for s in strategies if s in GRPO_STRATEGIES)
    if shapes.four_bit:  # QLoRA: the FSDP2 engine's FSDP2 and HSDP, without offload
        strategies = tuple(s for s in strategies if s in ("fsdp2", HSDP))
    if shapes.optim != FP32:  # DeepSpeed's flat partitions: not the row-blocked nor the bf16 state
        strategies = tuple(s for s in strategies if not s.startswith("zero"))
    if shapes.ep > 1:  # --ep: the FSDP2 engine's FSDP2 and HSDP, without offload
        strategies = tuple(s for s in strategies if s in ("fsdp2", HSDP))
    return strategies


def make_plan(
    shapes: Shapes,
    machine: Machine,
    block_size: int,
    global_batch_size: int,
    *,
    lora: bool = False,
    precisions: tuple[str, ...] = ("bf16", "fp32"),
    mfu: float = 0.4,
    flops_per_token: float = 0.0,
    dp_shard: int | None = None,
    cp: int = 1,
) -> PlanResult:
    """Every strategy × precision × checkpointing at micro-batch 1, and the recommendation: the
    fastest strategy that fits (bf16 first, without checkpointing first) at the largest micro-batch
    dividing the per-GPU share of the global batch. `dp_shard` smaller than the GPUs adds HSDP's rows
    (e.g. the GPUs of one node, replicated across nodes). `cp` > 1: the FSDP2 engine's context parallelism
    alone (its rows), each sequence over C GPUs: the global batch is split over the GPUs / C."""
    n = max(1, machine.num_gpus)
    dp = max(1, n // cp)
    if global_batch_size % dp:
        raise ValueError(
            f"--global_batch_size {global_batch_size} cannot be split over {dp} data-parallel ranks: use a multiple of {dp}"
        )
    if dp_shard is not None and (dp_shard < 1 or n % dp_shard):
        raise ValueError(
            f"--dp_shard {dp_shard} does not divide the {n} GPUs: use one of "
            f"{', '.join(map(str, divisors(n)))} (e.g. the GPUs of one node)"
        )
    strategies = strategies_for(shapes, dp_shard is not None and dp_shard < n, cp)
    result = PlanResult(
        shapes, machine, block_size, global_batch_size, mfu=mfu, flops_per_token=flops_per_token, dp_shard=dp_shard
    )
    result.cp = cp
    for precision in precisions:
        for strategy in strategies:
            for ckpt in (c for c in (False, True, SELECTIVE) if has_policy(strategy, c, cp)):
                result.rows.append(
                    row_for(shapes, machine, strategy, precision, ckpt, lora, 1, block_size, dp_shard, cp=cp)
                )
    _recommend(result, strategies, precisions, lora, global_batch_size // dp, cp)
    rec = result.recommended
    grpo = shapes.generation is not None  # generation runs whole rows on every rank: no --cp
    if cp == 1 and not grpo and machine.gpu_memory_bytes and (rec is None or rec.strategy.endswith("offload")):
        result.cp_advice = cp_advice(shapes, machine, block_size, lora)
    if shapes.optim == FP32 and machine.gpu_memory_bytes and (rec is None or rec.cpu_bytes):
        result.low_bit_advice = low_bit_advice(result, lora, mfu, flops_per_token)
    if shapes.dense_mask and machine.gpu_memory_bytes:
        mask_note(result, replace(shapes, dense_mask=False), lora, mfu, flops_per_token)
    if result.recommended is not None:
        timed = step_seconds(result, result.recommended, result.gradient_accumulation_steps)
        if timed is not None:
            result.step_seconds, result.offload_seconds = timed
    else:
        result.step_seconds = compute_seconds(result)
    return result
