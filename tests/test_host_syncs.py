"""Host synchronisations of an RL step do not grow with its micro-batch count.

On a GPU every ``.item()`` / ``float()`` / ``int()`` / ``bool()`` / ``.tolist()`` / ``.cpu()``
of a device tensor waits for the device's queue to drain, so a step that reads a metric back
per micro-batch (or per MoE layer) keeps the GPU idle between kernels. The step accumulates its
metrics as tensors and reads them back once per step. This test counts those calls (a
``TorchFunctionMode`` sees each one) made by megatron-sat's code over one ``rl_step`` with 2
and with 6 micro-batches of the same 24 samples: the counts must be equal, for the recipe's
objective (SAT-GSPO, R3, k3 KL) and a plain one (GRPO, live routing).

On the CPU every tensor is a host tensor, so the rule here is stricter than the GPU's, with two
exceptions, both named: the micro-batch builders (``HOST_BUILDERS``), which work on host
tensors on every machine before anything is staged on the device, and megatron-core's own
calls (its dropless MoE path reads token counts per expert back per layer: ``SequentialMLP``
and ``sort_chunks_by_idxs``; the grouped-GEMM / TE permute path is the remedy there, chosen by
the platform's fusion selection), which are attributed to megatron-core, not to the caller.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from test_split_invariance import attach_rollout_log_probs, make_samples
from torch.overrides import TorchFunctionMode

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.training.sampling_mask_tp import SamplingMask
from megatron_sat.training.trainer import PolicyTrainer

SYNCS = frozenset({"item", "tolist", "cpu", "__float__", "__int__", "__bool__", "__index__"})
# Functions that build micro-batches from the samples on the host (never on the device).
HOST_BUILDERS = frozenset({"place_tokens", "build_micro_batch", "pack_rows"})


def caller(stack: list[traceback.FrameSummary]) -> tuple[str, str] | None:
    """(module path, function) of the innermost megatron-sat or megatron-core frame."""
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        if "/megatron_sat/" in path or "/megatron/core/" in path:
            return path, frame.name
    return None


class CountSyncs(TorchFunctionMode):
    """Counts the tensor methods that read a value back to the host, by name, when
    megatron-sat's step code calls them (``all_counts``: every call, whoever makes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.all_counts: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            self.all_counts[name] += 1
            where = caller(traceback.extract_stack()[:-1])
            if where and "/megatron_sat/" in where[0] and where[1] not in HOST_BUILDERS:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def test_counter_sees_every_kind_of_read_back():
    t = torch.arange(3.0)
    with CountSyncs() as c:
        float(t.sum()), int(t[1]), bool(t.any()), t.tolist(), t.sum().item(), t.cpu()
        _ = max(t.sum(), 1.0)  # a comparison with a tensor is a bool()
    want = Counter(__float__=1, __int__=1, __bool__=2, tolist=1, item=1, cpu=1)
    assert c.all_counts == want
    assert c.counts == Counter()  # this test is not megatron-sat's code
    from megatron_sat.training.loss_reduction import global_loss_denominators

    with CountSyncs() as c:
        global_loss_denominators([torch.ones(2, 3), torch.ones(1, 4)], None)
    assert c.counts == Counter(tolist=1)  # read back once, whatever the number of masks


def syncs_per_step(trainer, samples, advantages, objective, micro_batch_size) -> Counter:
    trainer.train_config.micro_batch_size = micro_batch_size
    assert len(trainer.micro_batch_rows(samples)) == len(samples) // micro_batch_size
    with CountSyncs() as counter:
        trainer.rl_step(samples, advantages, objective, trainer_version=3)
    return counter.counts


@pytest.mark.slow  # four RL steps of the tiny model: ~25 s on this machine under load
@pytest.mark.parametrize(
    "use_r3, objective, sampling_mask",
    [
        (True, ObjectiveConfig(name="sat-gspo", kl_coef=1e-3), None),  # the recipe's objective
        (False, ObjectiveConfig(name="grpo"), None),
        (True, ObjectiveConfig(name="sat-gspo"), SamplingMask(0.8, 0.9, 20)),  # replayed mask
    ],
    ids=["sat-gspo-r3-kl", "grpo-live", "sat-gspo-sampling-mask"],
)
def test_host_syncs_do_not_grow_with_micro_batches(
    megatron_world, tiny_checkpoint, tiny_hf_config, use_r3, objective, sampling_mask
):
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(lr=1e-3, micro_batch_size=24, use_r3=use_r3),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
        reference=True,
        sampling_mask=sampling_mask,
    )
    samples = make_samples(trainer, tiny_hf_config["vocab_size"])
    attach_rollout_log_probs(trainer, samples)
    advantages = torch.linspace(-1.0, 1.0, len(samples))
    two = syncs_per_step(trainer, samples, advantages, objective, 12)
    six = syncs_per_step(trainer, samples, advantages, objective, 4)
    assert two == six, (two, six)
    assert six["tolist"] >= 2  # the denominators and the metrics, once each (the counter works)
