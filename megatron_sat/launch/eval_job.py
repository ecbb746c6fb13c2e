"""``megatron-sat eval``: avg@n and pass@k of a checkpoint on a held-out set, through rollout
servers, with the paper's sampling settings by default (temperature 1, top-p 1, top-k off, 16
samples per problem).

Servers: ``rollout.server_urls`` when given (they must report an integer ``weight_version``),
otherwise ``rollout.num_embedded_servers`` embedded CPU servers started on ``--checkpoint``.
Embedded servers start at SGLang's ``weight_version="default"``; the job tags them with the
integer ``step`` by pushing the checkpoint's own tensors through the weight-update protocol
(SGLang servers get ``--weight-version`` on their command line instead).

Outputs, under ``<run_dir>/eval/``: ``<name>_step<step>.jsonl`` (one row per problem: prompt,
label, per-sample rewards and responses) and ``results.jsonl`` (one row per evaluation: the
metrics, the checkpoint, the sampling settings); the metrics also go to the run's TensorBoard
as ``eval_<name>/<metric>`` at ``step``.

Rewards are the run's ``rollout.reward``: math-verify by default, or a plug-in or remote scorer
as in training, whose extra metrics are reported as ``reward/<name>`` (means over all samples);
pass@k then counts a sample with a reward > 0 as correct.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_sat.training.evaluate import mean_and_stderr


@dataclass(frozen=True)
class EvalOptions:
    """One evaluation.

    Attributes:
        data_path: held-out prompts (jsonl or parquet; the schemas of ``load_prompt_dataset``,
            or any keys through ``prompt_key``/``label_key``, e.g. AIME's problem/answer).
        name: metric prefix and file name; None = the data file's stem.
        checkpoint: HF checkpoint the embedded servers load; None = ``init_checkpoint``.
        num_samples: n samples per problem (avg@n), >= 1.
        temperature, top_p, top_k: sampling (SGLang semantics; top_k=-1 is off).
        max_new_tokens: generation limit; None = ``rollout.max_new_tokens``.
        pass_ks: the k of pass@k, each in [1, n]; empty = powers of two up to n, and n.
        step: TensorBoard step and weight version of the evaluated policy, >= 0.
        num_prompts: evaluate the first N problems; None = all.
        prompt_key, label_key: explicit dataset keys (see ``load_prompt_dataset``); the chat
            template settings are the run config's (``data.apply_chat_template[_kwargs]``).
    """

    data_path: str
    name: str | None = None
    checkpoint: str | None = None
    num_samples: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int | None = None
    pass_ks: tuple[int, ...] = field(default_factory=tuple)
    step: int = 0
    num_prompts: int | None = None
    prompt_key: str | None = None
    label_key: str | None = None

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"eval --num-samples must be >= 1, got {self.num_samples}")
        if self.temperature < 0:
            raise ValueError(f"eval --temperature must be >= 0, got {self.temperature}")
        if self.step < 0:
            raise ValueError(f"eval --step must be >= 0, got {self.step}")
        bad = [k for k in self.pass_ks if not 1 <= k <= self.num_samples]
        if bad:
            raise ValueError(f"eval --pass-k values {bad} are outside [1, {self.num_samples}]")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k values of pass@k that are reported."""
        if self.pass_ks:
            return tuple(sorted(set(self.pass_ks)))
        powers = [2**i for i in range(self.num_samples.bit_length()) if 2**i <= self.num_samples]
        return tuple(sorted(set(powers) | {self.num_samples}))


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples with c correct: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Eq. 1).

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    n, c = num_samples, num_correct
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(rewards: list[list[float]], ks: tuple[int, ...]) -> dict[str, float]:
    """avg@n (with its standard error over problems) and mean pass@k over problems.

    Args:
        rewards: per problem, the rewards of its n samples (1.0 = correct).
        ks: the k values of pass@k.
    """
    n = len(rewards[0])
    per_problem = [sum(r) / n for r in rewards]
    avg, se = mean_and_stderr(per_problem)
    out = {f"avg_at_{n}": avg, f"avg_at_{n}_stderr": se, "num_prompts": float(len(rewards))}
    for k in ks:
        correct = [sum(x > 0 for x in r) for r in rewards]
        out[f"pass_at_{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(rewards)
    return out


@contextlib.contextmanager
def _eval_reward(cfg):
    """The run's reward (``rollout.reward``): ``math`` scores in this process's threads, without
    math-verify's timeouts (as this job always has); ``python`` and ``http`` as in training
    (``rollout.reward_choice.open_reward``)."""
    from megatron_sat.rollout.reward_choice import open_reward
    from megatron_sat.rollout.rewards import math_reward

    if cfg.rollout.reward == "math":
        yield math_reward
        return
    with open_reward(cfg.rollout) as reward_fn:
        yield reward_fn


def run_eval(cfg, opts: EvalOptions) -> dict[str, float]:
    """Evaluate and write the results (see the module docstring). Returns the metrics.

    Raises:
        FileNotFoundError: the data file is missing.
        ValueError: for a server with a non-integer weight version, or a bad dataset row.
    """
    from torch.utils.tensorboard import SummaryWriter
    from transformers import AutoTokenizer

    from megatron_sat.checkpoint.hf_io import read_hf_tensors
    from megatron_sat.rollout.datasets import load_prompt_dataset
    from megatron_sat.rollout.pool import RolloutPool
    from megatron_sat.rollout.reward_plugins import check_finite_rewards, reward_metrics
    from megatron_sat.training.engines import rollout_clients
    from megatron_sat.weight_sync.broadcast import WeightUpdater

    checkpoint = opts.checkpoint or cfg.init_checkpoint
    cfg = dataclasses.replace(cfg, init_checkpoint=checkpoint)
    name = opts.name or Path(opts.data_path).stem
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    # The keys are the eval file's own; the prompt is rendered as in training (same template
    # and template arguments, e.g. enable_thinking).
    records = load_prompt_dataset(
        opts.data_path,
        input_key=opts.prompt_key,
        label_key=opts.label_key,
        apply_chat_template=cfg.data.apply_chat_template,
        apply_chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
        tokenizer=tokenizer,
    )
    records = records[: opts.num_prompts] if opts.num_prompts else records
    n = opts.num_samples
    with rollout_clients(cfg) as clients, _eval_reward(cfg) as reward_fn:
        if not cfg.rollout.server_urls:
            with WeightUpdater(clients) as updater:
                updater.update(iter(read_hf_tensors(checkpoint).items()), str(opts.step))
        pool = RolloutPool(
            clients, tokenizer, reward_fn, routing=None, stop_token_ids=[tokenizer.eos_token_id]
        )
        try:
            samples = pool.generate_groups(
                records,
                n,
                temperature=opts.temperature,
                top_p=opts.top_p,
                top_k=opts.top_k,
                max_new_tokens=opts.max_new_tokens or cfg.rollout.max_new_tokens,
                with_routing=False,
            )
        finally:
            pool.close()
    check_finite_rewards(samples)
    groups = [samples[i * n : (i + 1) * n] for i in range(len(records))]
    metrics = eval_metrics([[s.reward for s in g] for g in groups], opts.ks)
    metrics.update(reward_metrics(samples))  # a reward plug-in's extras, reward/<name>
    out_dir = Path(cfg.run_dir) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / f"{name}_step{opts.step}.jsonl").open("w") as f:
        for record, group in zip(records, groups, strict=True):
            row = {
                "source_index": record.source_index,
                "prompt": record.prompt,
                "label": record.label,
                "rewards": [s.reward for s in group],
                "num_correct": sum(s.reward > 0 for s in group),
                "responses": [s.response_text for s in group],
                "weight_versions": sorted({v for s in group for v in s.response_versions}),
            }
            f.write(json.dumps(row) + "\n")
    sampling = {
        "num_samples": n,
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "top_k": opts.top_k,
        "max_new_tokens": opts.max_new_tokens or cfg.rollout.max_new_tokens,
    }
    summary = {"step": opts.step, "name": name, "checkpoint": checkpoint, "data": opts.data_path}
    summary.update(metrics=metrics, sampling=sampling)
    with (out_dir / "results.jsonl").open("a") as f:
        f.write(json.dumps(summary) + "\n")
    writer = SummaryWriter(log_dir=str(cfg.run_dir))
    try:
        for key, value in metrics.items():
            writer.add_scalar(f"eval_{name}/{key}", value, opts.step)
    finally:
        writer.close()
    return metrics
