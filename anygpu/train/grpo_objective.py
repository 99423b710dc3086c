"""--objective grpo's step (the native engine calls it instead of reading a batch): one round of completions every
--num_iterations steps, sampled, scored and given advantages, then each micro-batch's share of the loss.

A round (`_roll_out`): the round's P prompts (the prompt order's global batch `round`), k completions each; this
rank samples its share (`rollout.rank_share`) with its generator: the policy's weights gathered once
(`generation.PolicyGenerator`), or a colocated vLLM engine they are pushed into (`vllm_generation`), each
completion keyed by (seed, round, prompt row, generation index): the same tokens on any world size,
micro-batch or resume. Rewards are scored where the completions are, gathered, and every rank computes the same
global advantages (`grpo.group_advantages`) and takes its share. The old policy's log-probs (--num_iterations > 1)
and the reference's (--beta > 0) are computed then, once per round. Each step's loss is `grpo.grpo_loss` over the
global counts: the same number whatever the split. Logged metrics keep TRL's names; a sample of prompts and
completions goes to <output_dir>/completions.jsonl at each logging step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from anygpu.data import prompts
from anygpu.data.order import eval_shards
from anygpu.runtime import distributed, parallel
from anygpu.train import generation, grpo, rollout
from anygpu.train.rewards import RewardSet

SAMPLES_FILE = "completions.jsonl"
ROUND_FILE = "grpo_round.json"  # in a checkpoint written within a round (`checkpoint_state`)
EVAL_ROUND = -1  # evaluation's sampling keys: the same draws at every evaluation, apart from any training round's
# not passed to reward functions as columns (TRL passes `prompts` itself, never a `completion` column)
PROMPT_COLUMNS = (prompts.IDS, *prompts.NOT_PASSED)

TokenLogps = Callable[[dict[str, torch.Tensor]], torch.Tensor]  # rows → (B, C) log-probs, no gradient


@dataclass(frozen=True)
class Config:
    """The GRPO arguments one step needs (TRL's names)."""

    num_generations: int
    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float | None
    num_iterations: int
    scale_rewards: str
    mask_truncated_completions: bool
    importance_sampling_level: str
    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    num_completions_to_print: int
    # --use_vllm's importance-sampling correction (None: off, or the policy samples): mode, clip min, clip max
    vllm_is: tuple[str, float | None, float | None] | None = None

    @classmethod
    def of(cls, args) -> Config:
        return cls(
            args.num_generations, args.loss_type[0], args.beta, args.epsilon, args.epsilon_high,
            args.num_iterations, args.scale_rewards, args.mask_truncated_completions,
            args.importance_sampling_level, args.max_completion_length, args.temperature, args.top_p, args.top_k,
            args.seed, args.num_completions_to_print,
            (args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_min,
             args.vllm_importance_sampling_clip_max)
            if args.use_vllm and args.vllm_importance_sampling_correction else None,
        )  # fmt: skip


@dataclass
class Drawn:
    """One completion of a round on this rank, as a checkpoint within the round keeps it."""

    ids: list[int]
    truncated: bool
    advantage: float
    old_logps: list[float] | None = None  # --num_iterations > 1: the policy's at generation time
    ref_logps: list[float] | None = None  # --beta > 0: the reference's
    sampling_logps: list[float] | None = None  # --use_vllm: vLLM's log-probs of the drawn tokens


@dataclass
class Round:
    """One round's training rows on this rank and what they are normalised and logged by."""

    index: int
    batches: list[dict[str, torch.Tensor]]  # per micro-batch: rows, advantages, old/ref log-probs
    counts: torch.Tensor  # the global [completions, completion tokens]
    tokens: tuple[int, int, int]  # the global batch's real and padded tokens, Σ length² (tokens/s, MFU)
    metrics: dict[str, float]  # reward and completion metrics of the global batch
    samples: list[dict[str, Any]]  # the global batch's first completions, for completions.jsonl
    drawn: list[Drawn]  # this rank's completions


class GRPOObjective:
    """What the native engine calls for a step and for the evaluation under --objective grpo."""

    def __init__(
        self,
        cfg: Config,
        rewards: RewardSet,
        prep,
        info: distributed.DistInfo,
        reference: TokenLogps | None,
        reference_line: str,
        output_dir: str,
        start_generator: Callable[[generation.Sampling], Any] = generation.PolicyGenerator,
    ) -> None:
        self.cfg, self.rewards, self.prep, self.info = cfg, rewards, prep, info
        self.reference, self.reference_line = reference, reference_line
        self.samples_path = Path(output_dir) / SAMPLES_FILE
        tok = prep.tokenizer
        self.sampling = generation.Sampling(
            cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_completion_length, stop_ids(tok, prep.config),
            tok.pad_token_id,
        )  # fmt: skip
        self.generator = start_generator(self.sampling)  # `complete(model, prompts, keys, version, batch_size)`
        self.round: Round | None = None
        self.saved: dict[str, Any] | None = None  # the round a resumed checkpoint was within
        self._sums: torch.Tensor | None = None  # the step's grpo.metric_sums, this rank's micro-batches
        self._step = 0

    # ------------------------------------------------------------------ a step
    def train_step(self, model, step: int) -> torch.Tensor:
        """Forward/backward of step `step` (0-based): this rank's part of the step's loss, on the device."""
        cfg, info = self.cfg, self.info
        index = step // cfg.num_iterations
        if self.round is None:
            self._keep_samples_until(step)
        if self.round is None or self.round.index != index:
            self.round = None  # the previous round's rows are freed before the next is generated
            self.round = self._roll_out(model, index)
        loss_sum = torch.zeros((), device=info.device)
        self._sums, self._step = None, step + 1
        batches = self.round.batches
        for j, batch in enumerate(batches):
            if parallel.is_sharded(model):
                parallel.set_gradient_reduction(model, last_micro_batch=j == len(batches) - 1)
            logps, entropies = rollout.token_log_probs(model, model, batch, cfg.temperature, entropy=True)
            loss, sums = grpo.grpo_loss(
                logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                batch["completion_mask"], self.round.counts, cfg.loss_type, cfg.beta, cfg.epsilon,
                cfg.epsilon_high, cfg.importance_sampling_level, cfg.max_completion_length, entropies,
                is_ratio=batch.get("is_ratio"),
            )  # fmt: skip
            (loss * info.world_size).backward()  # FSDP averages the ranks' gradients
            loss_sum += loss.detach()
            self._sums = sums if self._sums is None else self._sums + sums
        return loss_sum

    def logged(self) -> dict[str, float]:
        """The step's metrics (a collective: every rank calls it); rank 0 writes the step's samples."""
        sums = distributed.all_reduce_sum(self._sums.clone())
        out = dict(self.round.metrics)
        out.update(grpo.metric_means(sums.cpu(), self.cfg.beta, with_entropy=True))
        if self.info.is_main and self.cfg.num_completions_to_print:
            with self.samples_path.open("a") as f:
                for sample in self.round.samples[: self.cfg.num_completions_to_print]:
                    f.write(json.dumps({"step": self._step, **sample}, default=str) + "\n")
        return out

    def _keep_samples_until(self, step: int) -> None:
        """The run starts at `step` (0-based): completions.jsonl keeps what earlier steps wrote (a resume), no more."""
        if not self.info.is_main or not self.samples_path.exists():
            return
        kept = [line for line in self.samples_path.read_text().splitlines(keepends=True) if _step_of(line) <= step]
        self.samples_path.write_text("".join(kept))

    # the run log's token counts (`train.metrics.StepTokens`' interface): the round's rows, counted at each step
    padded = True

    def count(self, step: int, plan) -> tuple[int, int]:
        return self.round.tokens[0], self.round.tokens[1]

    def squares(self, step: int, plan) -> int:
        return self.round.tokens[2]

    # ------------------------------------------------------------------ a round
    def _roll_out(self, model, index: int) -> Round:
        """This rank's share of round `index`: drawn now, or (resumed within a round) as the checkpoint kept it."""
        cfg, info, data = self.cfg, self.info, self.prep.datasets["train"]
        share = rollout.rank_share(self.prep.order.global_batch(index), cfg.num_generations, info.rank, info.world_size)
        read = {i: data[i] for i in dict.fromkeys(share.prompts)}  # each prompt's row once, not once a completion
        rows = [read[i] for i in share.prompts]
        saved, self.saved = self.saved, None
        if saved is not None and saved["round"] == index:
            drawn = [Drawn(**d) for d in saved["drawn"][share.first : share.first + len(rows)]]
            metrics, samples = saved["metrics"], saved["samples"]
        else:
            drawn, metrics, samples = self._draw(model, index, share, rows)
        batches = self._batches(model, rows, drawn)
        counts = sum(grpo.batch_counts(b["completion_mask"]) for b in batches)
        lengths = torch.cat([b["attention_mask"].sum(-1) for b in batches]).double()
        tokens = torch.stack([lengths.sum(), lengths.new_tensor(sum(b["input_ids"].numel() for b in batches)),
                              (lengths**2).sum()])  # fmt: skip
        both = distributed.all_reduce_sum(torch.cat([counts.to(info.device), tokens]))
        if cfg.vllm_is is not None:  # a collective: every rank, with completions or without
            metrics = {**metrics, **self._is_metrics(batches)}
        return Round(index, batches, both[:2], tuple(int(v) for v in both[2:].tolist()), metrics, samples, drawn)

    def _is_metrics(self, batches: list[dict]) -> dict[str, float]:
        """TRL's `sampling/...` metrics of --use_vllm's correction over the global batch: the ratios (per token, or
        per completion in the sequence modes) and |policy − vLLM| log-prob per token."""
        ratios, gaps = [], []
        for b in batches:
            mask = b["completion_mask"].bool()
            r = b["is_ratio"]
            ratios.append(r.flatten() if r.shape[-1] == 1 else r[mask])
            gaps.append((b["old_logps"] - b["sampling_logps"])[mask].abs())
        r = torch.cat(ratios).double().cpu() if ratios else torch.zeros(0, dtype=torch.float64)
        g = torch.cat(gaps).double().cpu() if gaps else torch.zeros(0, dtype=torch.float64)
        g = g[~torch.isnan(g)]
        parts = distributed.all_gather_object(
            (r.sum().item(), r.numel(), r.min().item() if r.numel() else math.inf, r.max().item() if r.numel() else -math.inf,
             g.sum().item(), g.numel(), g.max().item() if g.numel() else 0.0)
        )  # fmt: skip
        n_r, n_g = sum(p[1] for p in parts), sum(p[5] for p in parts)
        return {
            "sampling/importance_sampling_ratio/min": min(p[2] for p in parts) if n_r else 1.0,
            "sampling/importance_sampling_ratio/mean": sum(p[0] for p in parts) / n_r if n_r else 1.0,
            "sampling/importance_sampling_ratio/max": max(p[3] for p in parts) if n_r else 1.0,
            "sampling/sampling_logp_difference/mean": sum(p[4] for p in parts) / n_g if n_g else 0.0,
            "sampling/sampling_logp_difference/max": max(p[6] for p in parts) if n_g else 0.0,
        }

    def _draw(self, model, index: int, share: rollout.Share, rows: list[dict]) -> tuple[list, dict, list]:
        """Sample and score this rank's completions; the global batch's advantages, metrics and first samples."""
        cfg = self.cfg
        if self.info.device.type == "cuda":  # the previous step's queued work is not sampling time
            torch.cuda.synchronize(self.info.device)
        start = time.perf_counter()
        done = self._sample(model, index, share.prompts, share.generations, rows)  # ends on the host: timed whole
        sampled = time.perf_counter()
        totals, per_func, texts = self._score(rows, done)
        seconds = (sampled - start, time.perf_counter() - sampled)
        shown = [
            {"prompt": r["prompt"], "completion": t, "reward": v, "generation": g}
            for r, t, v, g in zip(rows, texts, totals, share.generations)
        ][: cfg.num_completions_to_print]
        gathered = distributed.all_gather_object(
            (totals, [len(c.ids) for c in done], [c.truncated for c in done], shown, seconds)
        )
        every = torch.tensor([v for part in gathered for v in part[0]], dtype=torch.float64)
        advantages = grpo.group_advantages(every, cfg.num_generations, cfg.scale_rewards).tolist()
        mine = advantages[share.first : share.first + len(done)]
        drawn = [Drawn(list(c.ids), c.truncated, a, sampling_logps=c.logps) for c, a in zip(done, mine)]
        samples = [  # the global batch's first completions, with their advantages
            {**sample, "advantage": advantages[rank * len(done) + j]}
            for rank, part in enumerate(gathered)
            for j, sample in enumerate(part[3])
        ][: cfg.num_completions_to_print]
        return drawn, self._metrics(totals, per_func, gathered, every), samples

    def _sample(self, model, index: int, prompt_rows: list[int], generations: list[int], rows: list[dict]) -> list:
        keys = generation.sample_keys(self.cfg.seed, index, prompt_rows, generations, self.info.device)
        # a collective: every rank calls it, also one without prompts; the weights after the round's first step
        return self.generator.complete(model, [r["prompt_ids"] for r in rows], keys, index * self.cfg.num_iterations)

    def _score(self, rows: list[dict], done: list) -> tuple[list[float], dict[str, list[float]], list[str]]:
        """The reward functions' values for this rank's completions (TRL's arguments: the prompts as given,
        completions as text or one assistant message, their token ids, the rows' other columns)."""
        texts = self.prep.tokenizer.batch_decode([c.ids for c in done], skip_special_tokens=True)
        given = [r["prompt"] for r in rows]
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(given, texts)
        ]
        columns = {k: [r[k] for r in rows] for k in (rows[0] if rows else {}) if k not in PROMPT_COLUMNS}
        totals, per_func = self.rewards.score(given, completions, columns, [list(c.ids) for c in done])
        return totals, per_func, texts

    def _metrics(self, totals, per_func, gathered, every: torch.Tensor) -> dict[str, float]:
        """TRL's reward and completion metrics over the global batch."""
        out, _ = self._reward_metrics(totals, per_func)
        lengths = [n for part in gathered for n in part[1]]
        cut = [t for part in gathered for t in part[2]]
        ended = [n for n, t in zip(lengths, cut) if not t] or [0]  # TRL's 0 where none ended
        out.update(
            {
                "completions/mean_length": sum(lengths) / len(lengths),
                "completions/min_length": float(min(lengths)),
                "completions/max_length": float(max(lengths)),
                "completions/clipped_ratio": sum(cut) / len(cut),
                "completions/mean_terminated_length": sum(ended) / len(ended),
                "completions/min_terminated_length": float(min(ended)),
                "completions/max_terminated_length": float(max(ended)),
                "frac_reward_zero_std": grpo.zero_std_fraction(every, self.cfg.num_generations, self.cfg.scale_rewards),
                # the round's sampling and scoring on its slowest rank (every rank waits for it at the gather)
                "generation_seconds": max(part[4][0] for part in gathered),
                "reward_seconds": max(part[4][1] for part in gathered),
            }
        )
        return out

    def _batches(self, model, rows: list[dict], drawn: list[Drawn]) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of rows, with their advantages and the old/ref log-probs the loss needs
        (computed once a round, or the checkpoint's)."""
        cfg, device = self.cfg, self.info.device
        out = []
        for part in rollout.micro_batches(len(drawn), self.prep.plan.per_device_train_batch_size):
            mine = [drawn[i] for i in part]
            batch = rollout.rows(
                [rows[i]["prompt_ids"] for i in part], [d.ids for d in mine], self.sampling.pad_token_id, device
            )
            if cfg.mask_truncated_completions:  # DAPO: a cut completion adds nothing
                kept = torch.tensor([not d.truncated for d in mine], device=device)
                batch["completion_mask"] = batch["completion_mask"] * kept.long().unsqueeze(1)
            batch["advantages"] = torch.tensor([d.advantage for d in mine], dtype=torch.float32, device=device)
            out.append((batch, mine))
        with torch.no_grad():
            for batch, mine in out:  # the same forwards on every rank (a sharded model gathers per layer)
                if cfg.num_iterations > 1 or cfg.vllm_is is not None:  # TRL: the correction's reference point
                    batch["old_logps"] = self._per_token(mine, "old_logps", batch, lambda b: rollout.token_log_probs(
                        model, model, b, cfg.temperature)[0])  # fmt: skip
                if self.reference is not None:
                    batch["ref_logps"] = self._per_token(mine, "ref_logps", batch, self.reference)
                if cfg.vllm_is is not None:
                    batch["is_ratio"] = self._is_ratio(mine, batch)
        return [batch for batch, _ in out]

    def _is_ratio(self, mine: list[Drawn], batch: dict) -> torch.Tensor:
        """--use_vllm: the micro-batch's importance-sampling weights (`grpo.vllm_is_ratio`, TRL's)."""
        width = batch["completion_ids"].shape[1]
        rows = [d.sampling_logps + [0.0] * (width - len(d.ids)) for d in mine]
        batch["sampling_logps"] = torch.tensor(rows, dtype=torch.float32, device=batch["old_logps"].device)
        return grpo.vllm_is_ratio(
            batch["old_logps"], batch["sampling_logps"], batch["completion_mask"], *self.cfg.vllm_is
        )

    @staticmethod
    def _per_token(mine: list[Drawn], name: str, batch: dict, compute: Callable) -> torch.Tensor:
        """(B, C) log-probs of the micro-batch: the drawn completions' own (a resumed round), else computed now
        and kept with them (a checkpoint within the round saves them)."""
        width = batch["completion_ids"].shape[1]
        if getattr(mine[0], name) is not None:
            rows = [getattr(d, name) + [0.0] * (width - len(d.ids)) for d in mine]
            return torch.tensor(rows, dtype=torch.float32, device=batch["completion_ids"].device)
        values = compute(batch).float()
        for d, row in zip(mine, values.tolist()):
            setattr(d, name, row[: len(d.ids)])
        return values

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self, steps_done: int) -> dict[str, Any] | None:
        """A checkpoint within a round (--num_iterations > 1) keeps the round's completions, advantages and
        log-probs, gathered (a collective: every rank calls it), so a resume on any world size continues the
        same round; None at a round's end (the next round is drawn from the checkpoint's weights and keys)."""
        if steps_done % self.cfg.num_iterations == 0 or self.round is None:
            return None
        every = distributed.all_gather_object([dataclasses.asdict(d) for d in self.round.drawn])
        return {
            "round": self.round.index,
            "drawn": [d for part in every for d in part],
            "metrics": self.round.metrics,
            "samples": self.round.samples,
        }

    def resume(self, checkpoint: Path) -> None:
        """Resumed from `checkpoint`: the round it was within, if any (`checkpoint_state`)."""
        path = Path(checkpoint) / ROUND_FILE
        self.saved = json.loads(path.read_text()) if path.exists() else None

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, model, call, dataset, collator, batch_size: int, rank: int, world: int, device) -> dict:
        """One completion per validation prompt (keyed apart from training's draws), scored: eval_reward and TRL's
        other reward metrics, eval_completions/mean_length (the DPO objective's signature; `call`, `collator`
        unused)."""
        idx = [i for shard in eval_shards(len(dataset), world, rank, batch_size) for i in shard]
        rows = [dataset[i] for i in idx]
        keys = generation.sample_keys(self.cfg.seed, EVAL_ROUND, idx, [0] * len(idx), device)
        # every rank calls it, also one without prompts; the weights after the steps done so far
        done = self.generator.complete(model, [r["prompt_ids"] for r in rows], keys, self._step, batch_size)
        totals, per_func = self._score(rows, done)[:2] if rows else ([], {n: [] for n in self.rewards.names})
        metrics, (lengths, count) = self._reward_metrics(totals, per_func, [sum(len(c.ids) for c in done), len(done)])
        metrics["completions/mean_length"] = lengths / max(count, 1.0)
        return {f"eval_{k}": v for k, v in metrics.items()}

    def _reward_metrics(
        self, totals: list[float], per_func: dict[str, list[float]], more: list[float] = ()
    ) -> tuple[dict[str, float], list[float]]:
        """TRL's reward metrics over every rank's completions (a collective), and `more` summed in the same one."""
        moments = self.rewards.moments(totals, per_func)
        keys = sorted(moments)
        summed = distributed.all_reduce_sum(
            torch.tensor([moments[k] for k in keys] + [float(v) for v in more], dtype=torch.float64)
        ).tolist()
        return self.rewards.metrics(dict(zip(keys, summed[: len(keys)]))), summed[len(keys) :]

    def describe(self) -> list[str]:
        """The banner's lines on the objective."""
        cfg = self.cfg
        weights = ", ".join(f"{n} ×{w:g}" for n, w in zip(self.rewards.names, self.rewards.weights))
        clip = f"{cfg.epsilon:g}" + (f"/{cfg.epsilon_high:g}" if cfg.epsilon_high is not None else "")
        return [
            f"objective: grpo, loss {cfg.loss_type}, {cfg.num_generations} completions a prompt, beta {cfg.beta:g}, "
            f"clip {clip} ({cfg.importance_sampling_level} ratios), {cfg.num_iterations} step(s) a round; the "
            "global batch counts completions; dropout off",
            f"rewards: {weights}; advantages scaled by the {cfg.scale_rewards} std"
            + ("; truncated completions masked" if cfg.mask_truncated_completions else ""),
            f"sampling: temperature {cfg.temperature:g}, top_p {cfg.top_p:g}, top_k {cfg.top_k}, at most "
            f"{cfg.max_completion_length} tokens, keyed by (seed, round, prompt, generation); {self.generator.line}"
            + (
                f"; its draws weighted by TRL's importance-sampling correction ({cfg.vllm_is[0]}, bounds "
                f"{cfg.vllm_is[1]}..{cfg.vllm_is[2]})"
                if cfg.vllm_is
                else ""
            ),  # fmt: skip
            self.reference_line,
        ]


def stop_ids(tokenizer, config) -> tuple[int, ...]:
    """The tokens a completion ends on: the tokenizer's EOS and the model config's (a chat model may end a turn on
    another: Llama 3's <|eot_id|> beside <|end_of_text|>), as Hugging Face's generate would stop."""
    found = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    ids = [tokenizer.eos_token_id, *found]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None and 0 <= int(i) < len(tokenizer)))


def _step_of(line: str) -> float:
    """A completions.jsonl line's step; a line a crash cut short counts as past any step (dropped)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf
