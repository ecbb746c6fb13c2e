"""The trainer's micro-batches through megatron-core's pipeline schedule (PP > 1).

megatron-core's ``get_forward_backward_func()`` runs 1F1B over the pipeline stages (and the
interleaved schedule when ``virtual_pipeline_model_parallel_size`` is set): every stage calls
the forward step once per micro-batch, the first stage on the input ids, the others on the
hidden states received from the previous stage; the loss exists on the last stage only, and the
backward passes the output gradient back stage by stage. This module adapts the trainer's
per-micro-batch forwards to that contract; what the trainer computes around it (SAT's global
quantile, the global loss denominators, the metrics) is in :mod:`megatron_sat.training.trainer`.

Contract the trainer keeps (checked here):

- ``TransformerConfig.calculate_per_token_loss=True``: the trainer's losses are already shares
  of the global loss (normalised by batch-global denominators); without the flag the schedule
  divides every loss by its token count and by the micro-batch count.
- ``TransformerConfig.variable_seq_lengths=True``: the trainer's micro-batches are padded to
  their own longest sample and the last one may hold fewer rows, so the stages exchange each
  activation's shape before it (``p2p_communication._communicate_shapes``) instead of assuming
  one ``[seq, micro_batch, hidden]`` for all.
- ``TransformerConfig.finalize_model_grads_func`` unset: the schedule would divide gradients by
  the token count; the trainer reduces gradients itself after the schedule
  (``PolicyTrainer._finish_grads``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_sat.training.batching import MicroBatch
from megatron_sat.training.packing import PackedMicroBatch

Batch = MicroBatch | PackedMicroBatch
# (output tensor, loss function of the output or None): the output is the stage's hidden states
# [S, R, H] before the last stage, anything the loss function reads on the last one.
StageForward = Callable[
    [torch.nn.Module, Batch, int],
    tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None],
]


def check_pipeline_config(config) -> None:
    """Raise ``ValueError`` naming the ``TransformerConfig`` field the trainer's use of the
    schedule needs (see the module docstring)."""
    if not config.calculate_per_token_loss:
        raise ValueError(
            "TransformerConfig.calculate_per_token_loss must be True under pipeline parallelism: "
            "the trainer's losses are shares of the global loss and must not be rescaled"
        )
    if not config.variable_seq_lengths:
        raise ValueError(
            "TransformerConfig.variable_seq_lengths must be True under pipeline parallelism: "
            "the trainer's micro-batches differ in shape"
        )
    if config.finalize_model_grads_func is not None:
        raise ValueError(
            "TransformerConfig.finalize_model_grads_func must be unset: the schedule would "
            "divide gradients by the token count (the trainer reduces them itself)"
        )


def run_pipeline_schedule(
    model: torch.nn.Module,
    batches: Sequence[Batch],
    forward: StageForward,
    *,
    forward_only: bool,
) -> None:
    """Run megatron-core's pipeline schedule over ``batches`` on this stage.

    Every rank of a pipeline calls it with the same micro-batches (the same samples: they share
    a data-parallel rank), in the same order.

    Args:
        model: this rank's model chunk (the stage's layers; DDP-wrapped or not).
        batches: the micro-batches, fillers included (shapes may differ).
        forward: ``forward(model_chunk, batch, index) -> (output, loss_fn)``, run inside the
            schedule's forward step. On the last stage in training ``loss_fn(output)`` returns
            the 0-dim loss to backpropagate (already scaled as the caller wants the gradient);
            ``loss_fn`` may be None in ``forward_only`` runs (the caller keeps what it needs
            from ``output`` itself) and is never called on the other stages.
        forward_only: no backward (wrap the call in ``torch.no_grad()`` yourself).

    Raises:
        ValueError: a config the schedule would misuse (:func:`check_pipeline_config`), no
            micro-batch, or a training run whose ``forward`` gives no loss on the last stage.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    check_pipeline_config(get_model_config(model))
    if not batches:
        raise ValueError("the pipeline schedule needs at least one micro-batch")

    def forward_step(data_iterator, chunk):
        index, batch = next(data_iterator)
        output, loss_fn = forward(chunk, batch, index)

        def loss_func(out):  # called by the schedule on the last stage only
            if loss_fn is None:
                if not forward_only:
                    raise ValueError(f"micro-batch {index}: a training forward gave no loss")
                return out.new_zeros(()), torch.tensor(0, dtype=torch.int), {}
            return loss_fn(out), batch.samples.loss_mask.sum().to(torch.int), {}

        return output, loss_func

    rows, seq = batches[0].input_ids.shape
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(list(enumerate(batches))),
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq,  # ignored with variable_seq_lengths (shapes travel with the tensors)
        micro_batch_size=rows,
        forward_only=forward_only,
    )
