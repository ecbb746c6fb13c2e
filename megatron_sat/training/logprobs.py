"""Per-token log-probabilities from a megatron-core GPT forward, routing agreement, and the
pipeline-schedule driver that runs forward/backward over micro-batches with R3 replay.

Batches are :class:`~megatron_sat.training.batching.MicroBatch` (one sample per row) or
:class:`~megatron_sat.training.packing.PackedMicroBatch` (several per row); both give the model
input (``input_ids``, ``position_ids``, ``attention_mask``, ``labels``) in the model layout and
map model outputs back to the per-sample layout the losses read (``to_sample_layout``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megatron_sat.training.batching import MicroBatch
from megatron_sat.training.packing import PackedMicroBatch, use_position_ids_for_rope
from megatron_sat.training.sampling_mask_tp import SamplingMask, truncated_log_probs_tp

Batch = MicroBatch | PackedMicroBatch


def model_log_probs(
    model: torch.nn.Module, batch: Batch, mask: SamplingMask | None = None
) -> torch.Tensor:
    """One forward on ``batch``: per-token log pi(label) in the model layout, float32 [R, T]
    (under the rollout's truncated sampling distribution with ``mask``: ``fp32_log_probs``).

    On a pipeline stage other than the last, the stage's output hidden states instead (what
    megatron-core's GPTModel returns there). The log-probs are the vocab-parallel cross
    entropy of the logits cast to float32 first (``fp32_log_probs``), so they hold under
    tensor parallelism without gathering the vocabulary and never depend on the model's dtype
    or on megatron-core's cross-entropy fusion choice. For a packed batch, RoPE is first made
    to follow ``position_ids`` (:func:`use_position_ids_for_rope`, idempotent).
    """
    if isinstance(batch, PackedMicroBatch):
        use_position_ids_for_rope(model)
    out = model(batch.input_ids, batch.position_ids, batch.attention_mask)
    if not getattr(getattr(model, "module", model), "post_process", True):
        return out  # a stage's hidden states [S, R, H]
    return fp32_log_probs(out, batch.labels, mask)  # out: logits [R, T, V / TP]


def fp32_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, mask: SamplingMask | None = None
) -> torch.Tensor:
    """log softmax(logits)[label] over the whole (vocab-parallel) vocabulary, computed in
    float32 from ``logits`` cast to float32, as slime and verl compute log-probs for RL:
    a bf16 log-softmax would round every log-prob to bf16 (8 bits of mantissa: about 0.01
    nats at a log-prob of -3), which is the size of the train-rollout mismatch being measured.

    With ``mask`` (``rollout.replay_sampling_mask``), the log-probability under the
    rollout's sampling distribution instead: ``softmax(logits / T)`` truncated by SGLang's
    top-k / top-p rule (``training.sampling_mask_tp``, vocab-parallel, no gather); with a
    mask that only sets the temperature (``replayed_sampling_mask`` at T != 1), that of
    ``softmax(logits / T)``, as the engines return theirs.

    Args:
        logits: [..., V / TP] this TP rank's vocabulary shard, any float dtype.
        labels: [...] int64 token ids over the whole vocabulary.
        mask: the rollout's temperature, top_p and top_k to replay; None: the full softmax.

    Returns:
        float32 [...], differentiable with respect to ``logits`` (megatron-core's
        ``vocab_parallel_cross_entropy``, which overwrites its float32 input in place: the
        cast's output, or ``logits`` itself when already float32; the caller must not read
        ``logits`` again then; with ``mask`` ``logits`` is left as it is).
    """
    from megatron.core import parallel_state, tensor_parallel

    if mask is not None and mask.truncates:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        return truncated_log_probs_tp(logits, labels, mask, group)
    scaled = logits.float()
    if mask is not None and mask.temperature != 1.0:
        scaled = scaled / mask.temperature  # the engines' log-probs are softmax(logits / T)'s
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)


def forward_log_probs(
    model: torch.nn.Module, batch: Batch, mask: SamplingMask | None = None
) -> torch.Tensor:
    """log pi(labels | prefix) of every position in the sample layout: float32 [N, S]
    (truncated by ``mask``: ``fp32_log_probs``).

    Positions outside ``batch.samples.loss_mask`` hold log-probs of padding labels (or 0 where
    a packed batch has no token for that sample position): mask them.
    """
    return batch.to_sample_layout(model_log_probs(model, batch, mask))


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the whole vocabulary, from this TP rank's shard.

    ``H = log S - T / S`` with ``S = sum_v exp(l_v - m)``, ``T = sum_v exp(l_v - m) (l_v - m)``
    and m the (detached) global maximum: S and T are summed over the tensor-parallel group by
    megatron-core's all-reduce whose backward is the identity, which is the gradient of a loss
    every TP rank computes alike from H. Equal to ``-sum_v p_v log p_v`` up to rounding.

    Args:
        logits: [..., V / TP] any float dtype (computed in float32).

    Returns:
        float32 [...], nats; differentiable with respect to ``logits``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        m = logits.max(dim=-1, keepdim=True).values
        if tp > 1:
            torch.distributed.all_reduce(
                m,
                op=torch.distributed.ReduceOp.MAX,
                group=parallel_state.get_tensor_model_parallel_group(),
            )
    shifted = logits - m
    e = shifted.exp()
    total, weighted = e.sum(dim=-1), (e * shifted).sum(dim=-1)
    if tp > 1:
        total = reduce_from_tensor_model_parallel_region(total)
        weighted = reduce_from_tensor_model_parallel_region(weighted)
    return total.log() - weighted / total


def forward_log_probs_and_entropy(
    model: torch.nn.Module, batch: Batch, mask: SamplingMask | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(labels | prefix) and the policy's entropy at every position, sample layout,
    float32 [N, S] each, from one forward that keeps the (vocab-sharded) logits.

    The log-probs are :func:`fp32_log_probs` of the same logits (with ``mask``), exactly what
    :func:`forward_log_probs` computes; the entropy is the whole softmax's (the policy's, not
    the truncated sampler's). Single pipeline stage.
    """
    if isinstance(batch, PackedMicroBatch):
        use_position_ids_for_rope(model)
    logits = model(batch.input_ids, batch.position_ids, batch.attention_mask)  # [N, S, V/TP]
    # Entropy first: megatron-core's cross entropy overwrites its input in place, and with one
    # row the transposed logits are the logits themselves (no copy). The entropy's backward
    # keeps tensors of its own, not the logits.
    entropy = vocab_parallel_entropy(logits)
    log_probs = fp32_log_probs(logits, batch.labels, mask)
    return batch.to_sample_layout(log_probs), batch.to_sample_layout(entropy)


def routing_agreement(
    captured: Mapping[int, torch.Tensor], batch: Batch
) -> dict[str, torch.Tensor]:
    """How often the experts a forward used equal the rollout engine's, per layer and overall.

    Single rank without sequence parallelism (under SP/PP use the audit of
    :class:`megatron_sat.routing.replay.RoutingReplay`).

    Args:
        captured: Layer number -> bool routing map [T * R, E] from
            :func:`megatron_sat.routing.replay.capture_routing`.
        batch: The micro-batch whose ``routes`` hold the rollout engine's experts.

    Returns:
        ``{"topk_match": fraction, "topk_match_layer{l}": fraction, ...}`` over ``batch.active``
        (the tokens whose hidden states give response log-probs), counting a token as a match
        when its set of top-k experts is identical. 0-dim float tensors.

    Raises:
        ValueError: without routes, or when a captured map does not have one row per token.
    """
    if batch.routes is None:
        raise ValueError("micro-batch has no rollout routes to compare with")
    rows, seq = batch.input_ids.shape
    active = batch.active.transpose(0, 1).reshape(-1)  # sequence-major like the router
    out: dict[str, torch.Tensor] = {}
    matches = []
    for layer, used in sorted(captured.items()):
        if used.shape[0] != rows * seq:
            raise ValueError(
                f"layer {layer}: captured {used.shape[0]} tokens, the batch has {rows * seq}"
            )
        rollout = batch.routes[:, :, layer - 1].transpose(0, 1).reshape(seq * rows, -1).long()
        rollout_map = torch.zeros_like(used).scatter_(1, rollout, True)
        same = (rollout_map == used).all(dim=1)[active].float()
        out[f"topk_match_layer{layer}"] = same.mean()
        matches.append(same)
    out["topk_match"] = torch.cat(matches).mean()
    return out


LossFn = Callable[[torch.Tensor, Batch, int], tuple[torch.Tensor, dict[str, Any]]]


def forward_backward(
    model_chunks: Sequence[torch.nn.Module],
    batches: Sequence[Batch],
    loss_fn: LossFn,
    *,
    replay: Any | None = None,
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """Run megatron-core's schedule (``get_forward_backward_func``: no pipelining, or 1F1B
    under pipeline parallelism) over ``batches``, with R3 micro-batch keying.

    Args:
        model_chunks: this rank's model chunk(s) (one per virtual stage; DDP-wrapped or not).
        batches: the micro-batches, all of one shape [R, T] under pipeline parallelism.
        loss_fn: ``(log_probs [N, S] sample layout, batch, index) -> (loss, metrics)``, run on
            the last stage. The loss must already be normalised by batch-global denominators:
            the schedule adds the micro-batch losses' gradients as they are.
        replay: a :class:`megatron_sat.routing.replay.RoutingReplay` whose replay/record
            session is open around this call; each forward runs inside its
            ``micro_batch(index)``. None routes live.
        forward_only: no backward (wrap the call in ``torch.no_grad()`` yourself).

    Returns:
        On the last pipeline stage, per micro-batch the metrics ``loss_fn`` returned plus
        ``"loss"`` (detached clone); elsewhere an empty list.

    Raises:
        ValueError: if the model config lacks ``calculate_per_token_loss=True`` (without it the
            schedule divides every loss by the micro-batch count), has a
            ``finalize_model_grads_func`` (it would divide gradients by the token count; call
            ``finalize_model_grads(model_chunks)`` yourself after), or under pipeline
            parallelism the batches differ in shape.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    if not config.calculate_per_token_loss:
        raise ValueError(
            "forward_backward needs TransformerConfig.calculate_per_token_loss=True: losses "
            "here are normalised by batch-global denominators and must not be rescaled"
        )
    if config.finalize_model_grads_func is not None:
        raise ValueError(
            "forward_backward: unset config.finalize_model_grads_func (the schedule would "
            "divide gradients by the token count); call finalize_model_grads(model) after"
        )
    shapes = {tuple(b.input_ids.shape) for b in batches}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and len(shapes) > 1:
        raise ValueError(f"pipeline parallelism needs one micro-batch shape, got {shapes}")
    rows, seq = batches[0].input_ids.shape

    def forward_step(data_iterator, model):
        index, batch = next(data_iterator)
        ctx = replay.micro_batch(index) if replay is not None else contextlib.nullcontext()
        with ctx:
            output = model_log_probs(model, batch)

        def loss_func(output_tensor):
            loss, metrics = loss_fn(batch.to_sample_layout(output_tensor), batch, index)
            metrics = dict(metrics, loss=loss.detach().clone())
            num_tokens = batch.samples.loss_mask.sum().to(torch.int)
            return loss, num_tokens, metrics

        return output, loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(list(enumerate(batches))),
        model=list(model_chunks),
        num_microbatches=len(batches),
        seq_length=seq,
        micro_batch_size=rows,
        forward_only=forward_only,
    )
