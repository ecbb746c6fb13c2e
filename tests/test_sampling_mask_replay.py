"""Sampling-mask replay through the trainer (``rollout.replay_sampling_mask``): at equal weights
the log-prob ``PolicyTrainer``'s real no-grad pass computes with the mask equals the log-prob
of the distribution the embedded engine (SGLang's sampler rule, tests/test_sampling_mask.py)
drew each token from; without the mask the trainer's log-prob is the full softmax's, off by
the log of the kept mass. Also the config's refusals.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sat.config import ParallelConfig, RolloutConfig, RunConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.objectives.sampling_mask import truncated_log_probs
from megatron_sat.rollout.embedded.engine import EngineRequest, GenerationEngine
from megatron_sat.rollout.sampling import SamplingParams
from megatron_sat.rollout.types import Sample
from megatron_sat.training.sampling_mask_tp import SamplingMask, replayed_sampling_mask
from megatron_sat.training.trainer import PolicyTrainer


def engine_samples(checkpoint, sampling: SamplingParams, prompts: list[list[int]]):
    """The engine's samples, each token's log-prob under the engine's sampling distribution
    (from its own logits at that step, recorded inside ``_sample``) as ``rollout_log_probs``."""
    engine = GenerationEngine(str(checkpoint), seed=0, dtype="float32")
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    sample = engine._sample

    def recording(logits, params, positions=None):
        tokens, logprobs = sample(logits, params, positions)
        steps.append((logits.float().clone(), tokens.clone()))
        return tokens, logprobs

    engine._sample = recording
    outputs = engine.generate([EngineRequest(p, sampling) for p in prompts])
    samples = []
    for b, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        sampled = []
        for t, token in enumerate(out.output_ids):
            logits, tokens = steps[t]
            assert int(tokens[b]) == token
            sampled.append(
                float(
                    truncated_log_probs(
                        logits[b : b + 1],
                        tokens[b : b + 1],
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=sampling.top_k,
                    )
                )
            )
        samples.append(
            Sample(
                index=b,
                group_index=b // 2,
                prompt="",
                label="",
                prompt_ids=prompt,
                response_ids=list(out.output_ids),
                rollout_log_probs=sampled,
                response_versions=[0] * len(sampled),
            )
        )
    return samples


def gaps(trainer: PolicyTrainer, samples: list[Sample]) -> torch.Tensor:
    """|log pi_trainer - log q_engine| of every response token, through the trainer's no-grad
    log-prob pass (``passes.no_grad_log_probs``)."""
    mbs = trainer.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
    out = []
    for mb, (log_probs, _) in zip(mbs, trainer._no_grad_log_probs(mbs, replay=False), strict=True):
        mask = mb.samples.loss_mask.bool()
        out.append((log_probs - mb.rollout_log_probs)[mask].abs())
    return torch.cat(out)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6),
        SamplingParams(temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=6),
    ],
)
def test_replayed_log_probs_are_the_engines_sampling_distributions(
    megatron_world, tiny_checkpoint, tiny_hf_config, sampling
):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (int(n),), generator=gen).tolist() for n in range(2, 10)]
    samples = engine_samples(tiny_checkpoint, sampling, prompts)
    mask = SamplingMask(sampling.temperature, sampling.top_p, sampling.top_k)
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(use_r3=False, micro_batch_size=4),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
        sampling_mask=mask,
    )
    replayed = gaps(trainer, samples)
    trainer.sampling_mask = None  # the trainer without replay: the full softmax
    full = gaps(trainer, samples)
    print(f"{sampling}: |gap| replay max {replayed.max():.3e}, full mean {full.mean():.3e}")
    assert replayed.numel() == sum(len(s.response_ids) for s in samples) > 20
    # fp32 engine and fp32 trainer at equal weights: rounding only
    assert replayed.max() < 2e-5, replayed.max()
    # without replay every token is off by log(kept mass) (the tiny model's near-uniform
    # softmax over 64 tokens: top_p 0.9 drops about a tenth of the mass)
    assert full.mean() > 0.03 and full.min() > 1e-3, (full.mean(), full.min())


def test_config_refusals_and_mask():
    with pytest.raises(ValueError, match="no mask to replay"):
        RolloutConfig(replay_sampling_mask=True)
    with pytest.raises(ValueError, match="engine=vllm"):
        RolloutConfig(
            replay_sampling_mask=True, top_p=0.9, engine="vllm", server_urls=["http://x:1"]
        )
    replay = RolloutConfig(replay_sampling_mask=True, top_p=0.9)
    for objective in (
        ObjectiveConfig(name="sat-gspo"),  # ratio against the rollout's (untruncated) log mu
        ObjectiveConfig(name="grpo", tis_cap=2.0),  # corrects pi_old to log mu
    ):
        with pytest.raises(ValueError, match="untruncated behaviour policy"):
            RunConfig(rollout=replay, objective=objective)
    RunConfig(
        rollout=replay, objective=ObjectiveConfig(name="grpo", ratio_denominator="recomputed_old")
    )
    assert replayed_sampling_mask(RolloutConfig(top_p=0.9)) is None
    assert replayed_sampling_mask(
        RolloutConfig(replay_sampling_mask=True, temperature=0.6, top_k=5)
    ) == SamplingMask(0.6, 1.0, 5)


def test_the_temperature_is_applied_without_replay(megatron_world, tiny_checkpoint, tiny_hf_config):
    """SGLang's (and the embedded engine's) log-probs are those of softmax(logits / T): the
    trainer scores with the same temperature whether or not it replays a truncation (it
    scored softmax(logits) before, a mismatch of its own making at T != 1)."""
    sampling = SamplingParams(temperature=0.7, max_new_tokens=6)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (int(n),), generator=gen).tolist() for n in range(2, 8)]
    samples = engine_samples(tiny_checkpoint, sampling, prompts)
    mask = replayed_sampling_mask(RolloutConfig(temperature=0.7))
    assert mask == SamplingMask(0.7) and not mask.truncates
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(use_r3=False, micro_batch_size=4),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
        sampling_mask=mask,
    )
    tempered = gaps(trainer, samples)
    trainer.sampling_mask = None
    untempered = gaps(trainer, samples)
    assert tempered.max() < 2e-5, tempered.max()
    assert untempered.mean() > 1e-2, untempered.mean()
