"""The device check: the paper's RL step, weight push and resume, as one command.

    python3 tests/gpu/check_policy_trainer.py [--mode auto|device|cpu] [--json-out FILE]
        [--wheelhouse DIR] [--site DIR] [--tmp-dir DIR]

Runs the product's public pieces in the order a run uses them, prints one line per part, then
ONE line of JSON (every key of ``KEYS``; also written to ``--json-out``). Parts:

1. ``install``: the pins of tools/gpu_wheelhouse.txt that this Python lacks or holds at another
   version, installed offline from ``--wheelhouse`` (default ``wheelhouse/``, or
   ``$MEGATRON_SAT_WHEELHOUSE``) into ``--site``, put first on the paths
   (tests/gpu/wheelhouse_install.py), before torch is imported; then megatron-core is imported.
   Where every pin is present (the CPU venv) nothing is installed and the line says so.
2. ``build``: the recipe's model (examples/models/qwen3_30b_a3b.json: hidden 2048, 32 heads,
   128 experts, top-8, MoE FFN 768; here 2 layers and a 128-token vocabulary) built by
   ``PolicyTrainer`` with random weights and exported with ``save_hf`` (with the character
   tokenizer); then the run's trainer, loaded from that checkpoint, with the reference policy
   of the k3 KL. Its parameter count must equal ``launch.memory.count_parameters``.
3. ``rollouts``: an embedded server (megatron_sat/rollout/embedded/) on this host serving that
   checkpoint, the first weight push (version 0, the RL loop's initial sync) and the
   ``RolloutPool`` generating each step's groups with their routes (R3).
4. ``steps``: three ``rl_step``s of the recipe's objective (examples/configs/qwen3_30b_a3b_
   sat_gspo_r3.yaml: SAT-GSPO, R3, k3 KL 1e-3, live-routing diagnostic) with full recompute,
   bf16 parameters, 2 micro-batches per step, lr 1e-4 (the recipe's 1e-6 moves no bf16 weight
   in two steps), and a run checkpoint after step 2 (checkpoint/run_state.py). Each step:
   ``topk_match_r3`` must be 1.0, the loss finite, ``kl_loss`` > 0 from step 2 on.
5. ``push``: after step 2, version 2 pushed (weight_sync.megatron_push): the server's
   ``weight_version`` must go 0 -> 2 and its log-probs of one seeded request must change.
   Step 3's batch is generated after the push, so step 3's ``mismatch_abs_logratio`` is the
   log-prob gap trainer vs server on the same weights (``logprob_gap_trainer_vs_server``;
   step 1's, before any update: ``logprob_gap_initial``).
6. ``resume``: a fresh trainer loads the step-2 checkpoint and runs step 3 on the same batch;
   its metrics and parameters must equal the uninterrupted step 3's bit for bit. Step 3 runs
   with torch's deterministic algorithms in both runs (warn only; the ops without one are
   listed in ``deterministic_step_warnings``), so that a GPU's atomic scatter-adds cannot make
   two runs of it differ.

Modes: ``device`` (the widths above; what ``auto`` picks when CUDA is present) and ``cpu``
(small widths, 8 experts; what tests/test_device_check.py runs in CI). No part skips in either.
Exit status 0 when every part passed, else 1; the JSON line is printed either way (parts not
reached: "not run"; ``failure``: the first error).

Figures: ``step_time_s`` is step 2's wall time (step 1 carries the first-call costs, step 3 the
deterministic algorithms); ``host_syncs_per_step`` counts each ``rl_step``'s host
synchronisations (tests/gpu/host_syncs.py: CUDA's sync debug warnings; on the CPU an upper
bound, the host reads of tensors). Memory (CUDA only, null on the CPU):
``static_memory_bytes`` allocated before step 1 against the plan's ``plan_static_bytes``
(parameters, gradients, optimizer: ``launch.memory.estimate_memory``); ``step_memory_bytes``,
the peak allocated during a step's passes (up to the optimizer step) above what was allocated
when the step began, per padded token of the largest micro-batch and per layer:
``peak_memory_per_token_per_layer_bytes``, against the plan's
``plan_activation_bytes_per_token_per_layer`` (``launch.activation_memory`` for that
micro-batch, the model's kernels: ``plan_activation_kernels``) as ``activation_plan_error``
(|measured - plan| / plan; the plan's figure is printed on the CPU too).

Device time, estimated (no device was lent to the session that wrote it): install and imports
50 s, two builds and two loads of the 2.5 GB checkpoint 40 s, server start 30 s, five
generations on the host's CPU 60 s, two pushes of 2.5 GB over gloo 15 s, four steps 20 s, the
run checkpoint (17.5 GB: bf16 weights, fp32 main weights, two fp32 Adam moments; written and
hashed, then verified and read) 150 s: about 6.5 min, inside 8. To run it on a lent GPU: the
device tool sends the session's own checkout, so from that checkout's root (this branch merged)
first ``bash tools/gpu_wheelhouse.sh`` (46.9 MiB, under the 64 MiB a call carries), then::

    run(command="set -o pipefail; PYTHONUNBUFFERED=1 python3 tests/gpu/check_policy_trainer.py
        --json-out $OUT/device_check.json 2>&1 | tee $OUT/device_check.log",
        carry=["wheelhouse"], timeout_s=600)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wheelhouse_install import install, installed_version  # noqa: E402  (stdlib only)

PARTS = ("install", "build", "rollouts", "steps", "push", "resume")
RECIPE = ROOT / "examples" / "configs" / "qwen3_30b_a3b_sat_gspo_r3.yaml"
RECIPE_MODEL = ROOT / "examples" / "models" / "qwen3_30b_a3b.json"
NUM_STEPS = 3
SAVE_AFTER = 2  # the run checkpoint's step; the resumed trainer runs step SAVE_AFTER + 1
# Every key of the JSON line (tests/test_device_check.py checks them).
KEYS = (
    "ok",
    "mode",
    "device",
    "versions",
    "parts",
    "failure",
    "model",
    "params_dtype",
    "recompute_granularity",
    "optimizer_cpu_offload",
    "objective",
    "num_micro_batches",
    "tokens_per_step",
    "max_micro_batch_tokens",
    "max_micro_batch_shape",
    "step_times_s",
    "step_time_s",
    "host_syncs_per_step",
    "host_sync_counter",
    "static_memory_bytes",
    "plan_static_bytes",
    "step_memory_bytes",
    "optimizer_step_peak_bytes",
    "peak_memory_bytes",
    "peak_memory_per_token_per_layer_bytes",
    "plan_activation_bytes_per_token_per_layer",
    "plan_activation_kernels",
    "activation_plan_error",
    "loss",
    "kl_loss",
    "topk_match_r3",
    "logprob_gap_initial",
    "logprob_gap_trainer_vs_server",
    "server_versions",
    "push_s",
    "push_bytes",
    "push_changed_server_logprobs",
    "probe_logprob_max_change",
    "resume_bitwise",
    "resume_differences",
    "deterministic_step_warnings",
    "seconds",
    "total_s",
)


class CheckFailed(AssertionError):
    """A check of the device check did not hold (the message names it)."""


def require(ok: bool, what: str) -> None:
    """Raise ``CheckFailed(what)`` unless ``ok``."""
    if not ok:
        raise CheckFailed(what)


@dataclasses.dataclass(frozen=True)
class Mode:
    """What one mode runs.

    Attributes:
        name: "device" or "cpu".
        model: overrides of the recipe's model config (layers, and widths in cpu mode).
        num_prompts, group_size: prompts per step and samples per prompt.
        max_new_tokens: response length limit, tokens.
        micro_batch_size: samples per micro-batch (2 micro-batches per step).
        server_threads: OMP threads of the embedded server.
    """

    name: str
    model: dict[str, Any]
    num_prompts: int
    group_size: int
    max_new_tokens: int
    micro_batch_size: int
    server_threads: int


MODES = {
    "device": Mode("device", {"num_hidden_layers": 2}, 4, 4, 128, 8, 8),
    "cpu": Mode(
        "cpu",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        2,
        4,
        8,
        4,
        1,
    ),
}


def micro_batch_shapes(trainer, samples) -> list[tuple[int, int]]:
    """Per micro-batch of ``samples``: (rows, the longest row's tokens); their product is the
    micro-batch's padded tokens."""
    rows = trainer.micro_batch_rows(samples)
    return [(len(r), max(samples[i].num_tokens for i in r)) for r in rows]


def same_metrics(a: dict[str, float], b: dict[str, float]) -> list[str]:
    """Keys whose values differ bitwise (NaN equals NaN); keys of one dict only."""
    keys = sorted(set(a) | set(b))
    return [
        k
        for k in keys
        if k not in a or k not in b or not (a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])))
    ]


def cpu_params(trainer) -> dict[str, Any]:
    """Every model parameter (name -> a host copy)."""
    return {n: p.detach().cpu().clone() for n, p in trainer.model.module.named_parameters()}


# -- the run ---------------------------------------------------------------------------------
class Check:
    """The state the parts share and the report they fill."""

    def __init__(self, mode: Mode, tmp: Path, report: dict[str, Any]) -> None:
        import torch

        from megatron_sat.config.run import load_config

        self.mode = mode
        self.tmp = tmp
        self.cuda = torch.cuda.is_available()
        self.report = report  # KEYS, filled as the parts run
        report["mode"] = mode.name
        recipe = load_config(RECIPE)
        self.objective = recipe.objective
        self.train = dataclasses.replace(
            recipe.train,
            micro_batch_size=mode.micro_batch_size,
            max_tokens_per_micro_batch=None,
            recompute_granularity="full",
            params_dtype="bf16",
            # the recipe's optimizer offload (megatron-core's HybridDeviceOptimizer) runs on
            # CUDA only; the CPU mode's optimizer is in host memory anyway
            optimizer_cpu_offload=recipe.train.optimizer_cpu_offload and self.cuda,
            # the recipe's 1e-6 moves no bf16 weight in two steps: the push could not show
            lr=1e-4,
        )
        self.hf = self.model_config()
        self.ckpt = tmp / "hf"
        self.run_dir = tmp / "run"
        self.trainer = None
        self.client = self.updater = self.pool = None  # start_rollouts
        self.batches: list[tuple[list, Any]] = []
        self.metrics: list[dict[str, float]] = []

    def model_config(self) -> dict[str, Any]:
        """The recipe's model with the mode's overrides and the character tokenizer's vocabulary
        (128 >= its 100 tokens) and special ids."""
        from megatron_sat.rollout.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        hf = json.loads(RECIPE_MODEL.read_text())
        hf.update(self.mode.model, vocab_size=128, max_position_embeddings=1024)
        hf.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        hf.update(bos_token_id=tok.eos_token_id)
        return hf

    def new_trainer(self, load_from: Path | None):
        from megatron_sat.config import ParallelConfig
        from megatron_sat.training.trainer import PolicyTrainer

        return PolicyTrainer(
            self.hf,
            self.train,
            ParallelConfig(),
            pad_token_id=self.hf["pad_token_id"],
            load_from=load_from,
            reference=self.objective.kl_coef > 0,
        )

    def build(self) -> str:
        """Part 2 (module docstring)."""
        import torch

        from megatron_sat.launch.memory import count_parameters
        from megatron_sat.rollout.tokenizer import build_char_tokenizer

        build_char_tokenizer().save_pretrained(self.tmp / "tokenizer")
        first = self.new_trainer(load_from=None)
        first.save_hf(self.ckpt, tokenizer_dir=self.tmp / "tokenizer")
        del first
        gc.collect()
        self.trainer = self.new_trainer(load_from=self.ckpt)
        layers, top_k, experts = self.trainer.routing_shape
        num_params = sum(p.numel() for p in self.trainer.model.module.parameters())
        require(num_params == count_parameters(self.hf).total, "parameter count vs the plan")
        self.report["model"] = dict(
            hidden_size=self.hf["hidden_size"],
            num_layers=layers,
            num_experts=experts,
            top_k=top_k,
            moe_ffn_hidden_size=self.hf["moe_intermediate_size"],
            vocab_size=self.hf["vocab_size"],
            num_parameters=num_params,
        )
        self.report.update(
            params_dtype=str(next(self.trainer.model.module.parameters()).dtype),
            recompute_granularity=self.train.recompute_granularity,
            optimizer_cpu_offload=self.train.optimizer_cpu_offload,
            objective=dataclasses.asdict(self.objective),
            device=torch.cuda.get_device_name() if self.cuda else "cpu",
        )
        return f"{num_params:,} parameters, {layers} layers x {experts} experts top-{top_k}"

    def plan_activation_bytes(self, rows: int, seq_len: int) -> int:
        """The plan's activation bytes of one micro-batch of ``rows`` rows of ``seq_len``
        tokens (``launch.activation_memory``: the decoder's saved bytes plus one recomputed
        chunk under the run's recompute settings, and the output layer's peak), for the kernels
        the model was built with (transformer-engine's when any of its modules is TE's)."""
        from megatron_sat.launch.activation_memory import (
            ActivationLayout,
            ModelDims,
            decoder_activations,
            output_activations,
        )

        te = any(
            type(m).__module__.startswith("megatron.core.extensions.transformer_engine")
            for m in self.trainer.model.modules()
        )
        self.report["plan_activation_kernels"] = "transformer_engine" if te else "local"
        kw = dict(
            tokens=rows * seq_len, seq_len=seq_len, kernels=self.report["plan_activation_kernels"]
        )
        dims, layout = ModelDims.from_hf(self.hf), ActivationLayout()
        decoder = decoder_activations(
            dims,
            layout,
            layers=range(self.report["model"]["num_layers"]),
            granularity=self.train.recompute_granularity,
            recompute_num_layers=self.train.recompute_num_layers,
            **kw,
        )
        output = output_activations(dims, layout, **kw)
        return decoder.saved_bytes + decoder.recompute_bytes + output.peak_bytes

    def plan_static_bytes(self) -> int:
        """Parameters + gradients + optimizer bytes of the trainer by ``launch.memory``."""
        from megatron_sat.launch.memory import count_parameters, estimate_memory

        estimate = estimate_memory(
            count_parameters(self.hf),
            tp=1,
            pp=1,
            ep=1,
            etp=1,
            layout=self.trainer.optimizer_layout,
            dense_shards=1,
            expert_shards=1,
            server_tp=1,
        )
        return estimate.trainer_bytes

    # -- parts' bookkeeping ----------------------------------------------------------------
    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time a piece of part ``name`` (seconds add up over its pieces); "ok" once a piece
        ends, "failed: why" when one raises (re-raised)."""
        start = time.perf_counter()
        try:
            yield
        except BaseException as e:
            self.report["parts"][name] = f"failed: {type(e).__name__}: {e}"[:500]
            raise
        finally:
            seconds = self.report["seconds"]
            seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - start, 3)
        self.report["parts"][name] = "ok"

    # -- rollouts ------------------------------------------------------------------------------
    def start_rollouts(self, server) -> str:
        """Part 3's set-up: the updater, the initial push (version 0) and the pool."""
        from megatron_sat.rollout.client import RoutingSpec
        from megatron_sat.rollout.pool import RolloutPool
        from megatron_sat.rollout.tokenizer import build_char_tokenizer
        from megatron_sat.weight_sync.broadcast import WeightUpdater
        from megatron_sat.weight_sync.megatron_push import push_megatron_weights

        self.client = server.client()
        self.updater = WeightUpdater([self.client], backend="gloo")
        self.updater.connect()
        versions = [self.client.get_weight_version()]
        push_megatron_weights(self.trainer.model, self.hf, self.updater, "0")
        versions.append(self.client.get_weight_version())
        require(versions == ["default", "0"], f"server versions {versions} by the initial push")
        self.report["server_versions"] = versions
        tokenizer = build_char_tokenizer()
        self.pool = RolloutPool(
            [self.client],
            tokenizer,
            digit_share,
            routing=RoutingSpec(*self.trainer.routing_shape),
            stop_token_ids=[tokenizer.eos_token_id],
        )
        return f"server {server.url} at version 0"

    def generate(self, seed: int) -> tuple[list, Any]:
        """One step's groups from the server (seeded per sample) and their GRPO advantages."""
        import torch

        from megatron_sat.objectives.advantages import compute_grpo_advantages

        m = self.mode
        samples = self.pool.generate_groups(
            records(m.num_prompts),
            m.group_size,
            temperature=1.0,
            max_new_tokens=m.max_new_tokens,
            seed_of=lambda r, s: seed * 1000 + r * m.group_size + s,
        )
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        return samples, compute_grpo_advantages(rewards, m.group_size)

    def probe(self) -> list[float]:
        """The server's log-probs of one seeded request (the same before and after a push)."""
        (sample,) = self.pool.generate_groups(
            records(1), 1, temperature=1.0, max_new_tokens=8, seed_of=lambda r, s: 999
        )
        return sample.rollout_log_probs

    # -- steps ---------------------------------------------------------------------------------
    def rl_step(self, trainer, step: int) -> tuple[dict[str, float], dict[str, Any]]:
        """``rl_step`` number ``step`` (1-based) on its batch: (metrics, measurements). The
        compared step (``SAVE_AFTER + 1``) runs with torch's deterministic algorithms (warn
        only: ``measured["messages"]`` names the ops without one), so that scatter-adds and
        the like cannot make two runs of it differ on a GPU; the others as a run has them."""
        import torch
        from host_syncs import HostSyncCounter

        samples, advantages = self.batches[step - 1]
        peaks = []
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step_start = self._watch_optimizer(trainer, peaks)
        counter = HostSyncCounter(self.cuda)
        torch.use_deterministic_algorithms(step == SAVE_AFTER + 1, warn_only=True)
        start = time.perf_counter()
        try:
            with counter:
                metrics = trainer.rl_step(
                    samples, advantages, self.objective, trainer_version=step - 1
                )
            if self.cuda:
                torch.cuda.synchronize()
        finally:
            torch.use_deterministic_algorithms(False)
        seconds = time.perf_counter() - start
        measured = dict(
            seconds=seconds,
            syncs=counter.count,
            shapes=micro_batch_shapes(trainer, samples),
            messages=counter.messages,
        )
        if self.cuda:
            require(bool(peaks), "rl_step ran no trainer.optimizer.step: no passes' peak")
            measured.update(
                static=step_start,
                passes_peak=peaks[0] - step_start,
                peak=torch.cuda.max_memory_allocated(),
            )
        return metrics, measured

    @staticmethod
    def _watch_optimizer(trainer, peaks: list[int]) -> int:
        """Record the peak allocated bytes when the optimizer step starts (the passes' peak)
        into ``peaks``, once; returns the bytes allocated now."""
        import torch

        step = trainer.optimizer.step

        def watched(*args, **kwargs):
            peaks.append(torch.cuda.max_memory_allocated())
            trainer.optimizer.step = step
            return step(*args, **kwargs)

        trainer.optimizer.step = watched
        return torch.cuda.memory_allocated()

    def check_step(self, step: int, metrics: dict[str, float]) -> None:
        require(math.isfinite(metrics["loss"]), f"step {step}: loss {metrics['loss']}")
        require(metrics["topk_match_r3"] == 1.0, f"step {step}: topk_match_r3 {metrics}")
        require("kl_loss" in metrics, f"step {step}: no kl_loss (reference policy)")
        if step > 1:  # the policy moved away from the reference
            require(metrics["kl_loss"] > 0, f"step {step}: kl_loss {metrics['kl_loss']}")

    def save(self) -> Path:
        from megatron_sat.checkpoint.run_state import save_run_checkpoint

        return save_run_checkpoint(
            self.run_dir,
            model=self.trainer.model,
            optimizer=self.trainer.optimizer,
            step=SAVE_AFTER,
            weight_version=0,
        )

    def push(self) -> str:
        """Part 5 (module docstring)."""
        from megatron_sat.weight_sync.megatron_push import push_megatron_weights

        before = self.probe()
        start = time.perf_counter()
        stats = push_megatron_weights(self.trainer.model, self.hf, self.updater, str(SAVE_AFTER))
        self.report["push_s"] = round(time.perf_counter() - start, 3)
        self.report["push_bytes"] = stats.num_bytes
        version = self.client.get_weight_version()
        self.report["server_versions"].append(version)
        after = self.probe()
        common = min(len(before), len(after))
        change = max((abs(a - b) for a, b in zip(before[:common], after[:common])), default=0.0)
        self.report["probe_logprob_max_change"] = change
        self.report["push_changed_server_logprobs"] = before != after
        require(version == str(SAVE_AFTER), f"server weight_version {version} after the push")
        require(before != after, "the server's log-probs of a seeded request did not change")
        return f"{stats.num_bytes / 2**20:.1f} MiB in {self.report['push_s']} s, version {version}"

    def resume(self, expected: dict[str, float], params: dict[str, Any]) -> str:
        """Part 6: a fresh trainer, the step-2 checkpoint, step 3; compared bitwise."""
        import torch

        from megatron_sat.checkpoint.run_state import load_run_checkpoint

        trainer = self.new_trainer(load_from=self.ckpt)
        state = load_run_checkpoint(self.run_dir, model=trainer.model, optimizer=trainer.optimizer)
        require(state.step == SAVE_AFTER, f"resumed at step {state.step}")
        loaded = cpu_params(trainer)
        metrics, _ = self.rl_step(trainer, SAVE_AFTER + 1)
        got = cpu_params(trainer)
        differences = same_metrics(expected, metrics)
        differences += [n for n in params if not torch.equal(params[n], got[n])]
        self.report["resume_differences"] = differences[:20]
        self.report["resume_bitwise"] = not differences
        moved = [n for n in loaded if not torch.equal(loaded[n], got[n])]
        require(bool(moved), "step 3 changed no parameter: the comparison would be vacuous")
        require(not differences, f"resumed step 3 differs: {differences[:5]}")
        return f"step {SAVE_AFTER + 1} bitwise equal: loss {metrics['loss']!r}, {len(got)} params"


def records(num: int) -> list:
    """``num`` arithmetic prompts of the character alphabet, about 60 characters each."""
    from megatron_sat.rollout.datasets import PromptRecord

    return [
        PromptRecord(
            f"Add the numbers and put the sum in a box: {17 * i + 3} + {29 * i + 8} =",
            str(46 * i + 11),
            i,
        )
        for i in range(num)
    ]


def digit_share(text: str, label: str) -> float:
    """Reward: the share of digits in the response (spread within a group, so that advantages
    are not all zero, even for a random model)."""
    del label
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def run_steps(check: Check) -> None:
    """Parts 3 to 6 around one embedded server."""
    from megatron_sat.rollout.embedded.launch import EmbeddedServer

    env = {"OMP_NUM_THREADS": str(check.mode.server_threads)}
    with contextlib.ExitStack() as stack:
        with check.part("rollouts"):  # the server's start counts
            server = stack.enter_context(EmbeddedServer(str(check.ckpt), random_seed=0, env=env))
        try:
            with check.part("rollouts"):
                say("rollouts", check.start_rollouts(server))
            measured = []
            for step in range(1, NUM_STEPS + 1):
                with check.part("rollouts"):
                    check.batches.append(check.generate(seed=step))
                with check.part("steps"):
                    metrics, m = check.rl_step(check.trainer, step)
                    check.check_step(step, metrics)
                    check.metrics.append(metrics)
                    measured.append(m)
                    say("steps", f"step {step}: {m['seconds']:.3f} s, {m['syncs']} host syncs")
                    if step == SAVE_AFTER:
                        say("steps", f"run checkpoint {check.save()}")
                if step == SAVE_AFTER:
                    with check.part("push"):
                        say("push", check.push())
        finally:
            for user in (check.pool, check.updater):
                if user is not None:
                    user.close()
    summarize(check, measured)


def summarize(check: Check, measured: list[dict[str, Any]]) -> None:
    """The steps' figures into the report."""
    from host_syncs import counter_method

    r, metrics = check.report, check.metrics
    layers = r["model"]["num_layers"]
    shape = max((sh for m in measured for sh in m["shapes"]), key=lambda sh: sh[0] * sh[1])
    largest = shape[0] * shape[1]
    plan = check.plan_activation_bytes(*shape)
    r.update(
        num_micro_batches=[len(m["shapes"]) for m in measured],
        tokens_per_step=[sum(rows * seq for rows, seq in m["shapes"]) for m in measured],
        max_micro_batch_tokens=largest,
        max_micro_batch_shape=list(shape),
        step_times_s=[round(m["seconds"], 4) for m in measured],
        # step 2: step 1 carries the first-call costs (allocator, kernel choices), step 3 runs
        # with deterministic algorithms (compared bitwise after the resume)
        step_time_s=round(measured[1]["seconds"], 4),
        deterministic_step_warnings=measured[SAVE_AFTER]["messages"],
        host_syncs_per_step=[m["syncs"] for m in measured],
        host_sync_counter=counter_method(check.cuda),
        plan_static_bytes=check.plan_static_bytes(),
        plan_activation_bytes_per_token_per_layer=round(plan / (largest * layers), 1),
        loss=[x["loss"] for x in metrics],
        kl_loss=[x["kl_loss"] for x in metrics],
        topk_match_r3=[x["topk_match_r3"] for x in metrics],
        logprob_gap_initial=metrics[0]["mismatch_abs_logratio"],
        logprob_gap_trainer_vs_server=metrics[SAVE_AFTER]["mismatch_abs_logratio"],
    )
    if check.cuda:
        step_memory = max(m["passes_peak"] for m in measured)
        r.update(
            static_memory_bytes=measured[0]["static"],
            step_memory_bytes=step_memory,
            optimizer_step_peak_bytes=max(m["peak"] - m["static"] for m in measured),
            peak_memory_bytes=max(m["peak"] for m in measured),
            peak_memory_per_token_per_layer_bytes=round(step_memory / (largest * layers), 1),
            # (the measured peak also holds the micro-batch's tensors and allocator rounding)
            activation_plan_error=round(abs(step_memory - plan) / plan, 4),
        )


_START = time.perf_counter()


def say(part: str, line: str) -> None:
    """One line of ``part``, with the seconds since the start (a run cut short by its time
    limit still shows how far each part got)."""
    print(f"{part}: {line} [{time.perf_counter() - _START:.1f} s]", flush=True)


def run(
    mode_name: str, wheelhouse: Path, site: Path, tmp_dir: Path | None, report: dict[str, Any]
) -> None:
    """Every part in order, filling ``report`` (the install's own entries, then the check's)."""
    start = time.perf_counter()
    report["parts"]["install"] = "failed"
    say("install", install(wheelhouse, site))
    # What the trainer imports lazily, imported here so that a failed install fails at once.
    import megatron.core  # noqa: F401
    import torch

    report["parts"]["install"] = "ok"
    report["seconds"]["install"] = round(time.perf_counter() - start, 3)  # imports included

    if mode_name == "auto":
        mode_name = "device" if torch.cuda.is_available() else "cpu"
    require(mode_name == "cpu" or torch.cuda.is_available(), "--mode device needs a CUDA device")
    report["versions"] = {
        n: installed_version(n) for n in ("torch", "megatron-core", "transformers")
    }
    with tempfile.TemporaryDirectory(prefix="device_check_", dir=tmp_dir) as tmp:
        check = Check(MODES[mode_name], Path(tmp), report)
        with check.part("build"):
            say("build", check.build())
        run_steps(check)
        expected, params = check.metrics[SAVE_AFTER], cpu_params(check.trainer)
        check.trainer = None
        gc.collect()
        if check.cuda:
            torch.cuda.empty_cache()
        with check.part("resume"):
            say("resume", check.resume(expected, params))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("auto", *MODES), default="auto")
    parser.add_argument(
        "--wheelhouse",
        type=Path,
        default=Path(os.environ.get("MEGATRON_SAT_WHEELHOUSE", ROOT / "wheelhouse")),
    )
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "device_site")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--tmp-dir", type=Path, default=None, help="for the checkpoints (default: the system's)"
    )
    args = parser.parse_args(argv)
    # Before CUDA starts: cuBLAS's deterministic workspace, which torch's deterministic
    # algorithms (the compared step) require.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.mode == "cpu":
        # Before torch starts: the CPU mode on a CUDA host must not reach the GPU through the
        # trainer's own device choice (platform.device picks CUDA whenever it is visible); the
        # embedded server's subprocess inherits this too.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # The embedded server's subprocess imports this checkout's package too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    start = time.perf_counter()
    report: dict[str, Any] = dict.fromkeys(KEYS)
    report.update(parts=dict.fromkeys(PARTS, "not run"), seconds={}, mode=args.mode)
    try:
        run(args.mode, args.wheelhouse, args.site, args.tmp_dir, report)
    except Exception as e:  # reported in the JSON line and the exit status
        traceback.print_exc()
        report["failure"] = f"{type(e).__name__}: {e}"[:2000]
    report["total_s"] = round(time.perf_counter() - start, 3)
    report["ok"] = report["failure"] is None and all(v == "ok" for v in report["parts"].values())
    line = json.dumps(report, default=str)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line, flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
