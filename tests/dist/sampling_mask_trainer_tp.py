"""torchrun (2 gloo ranks, TP2 with sequence parallelism): ``PolicyTrainer``'s no-grad
log-prob pass with a ``sampling_mask`` (``rollout.replay_sampling_mask``) equals the
full-vocabulary ``objectives.sampling_mask.truncated_log_probs`` of the same forward's logits
all-gathered over the TP group: the vocab-parallel replay is wired to megatron-core's TP group.

    torchrun --nproc_per_node=2 tests/dist/sampling_mask_trainer_tp.py CHECKPOINT

Prints ``SAMPLING_MASK_TRAINER_TP_OK`` on rank 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(checkpoint: str) -> None:
    from megatron.core import parallel_state

    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.objectives.sampling_mask import truncated_log_probs
    from megatron_sat.rollout.types import Sample
    from megatron_sat.training.sampling_mask_tp import SamplingMask
    from megatron_sat.training.staging import staged
    from megatron_sat.training.trainer import PolicyTrainer

    hf_config = json.loads((Path(checkpoint) / "config.json").read_text())
    vocab = hf_config["vocab_size"]
    mask = SamplingMask(temperature=0.8, top_p=0.9, top_k=30)
    trainer = PolicyTrainer(
        hf_config,
        TrainConfig(use_r3=False, micro_batch_size=4),
        ParallelConfig(tensor_model_parallel_size=2),
        pad_token_id=0,
        load_from=checkpoint,
        sampling_mask=mask,
    )
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    gen = torch.Generator().manual_seed(0)  # the same samples on both TP ranks
    samples = []
    for i in range(8):
        p, r = 2 + i % 3, 3 + i % 4
        ids = torch.randint(3, vocab, (p + r,), generator=gen).tolist()
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                prompt="",
                label="",
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                rollout_log_probs=[0.0] * r,
                response_versions=[0] * r,
            )
        )
    mbs = trainer.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
    replayed = trainer._no_grad_log_probs(mbs, replay=False)
    group = parallel_state.get_tensor_model_parallel_group()
    checked = 0
    with torch.no_grad():
        for host_mb, (log_probs, _) in zip(mbs, replayed, strict=True):
            with staged(host_mb, trainer.device) as mb:
                shard = trainer.model(mb.input_ids, mb.position_ids, mb.attention_mask).float()
                parts = [torch.empty_like(shard) for _ in range(2)]
                dist.all_gather(parts, shard.contiguous(), group=group)
                full = torch.cat(parts, dim=-1)  # [R, T, V]
                ref = truncated_log_probs(
                    full.reshape(-1, full.shape[-1]),
                    mb.labels.reshape(-1),
                    temperature=mask.temperature,
                    top_p=mask.top_p,
                    top_k=mask.top_k,
                ).view(mb.labels.shape)
                active = mb.samples.loss_mask.bool()
                want = mb.to_sample_layout(ref)[active]
                torch.testing.assert_close(log_probs[active], want, rtol=1e-5, atol=1e-5)
                # and the replay changed something: the full softmax's log-probs differ
                plain = torch.log_softmax(full / mask.temperature, -1)
                plain = plain.gather(-1, mb.labels[..., None]).squeeze(-1)
                assert (mb.to_sample_layout(plain)[active] - want).abs().max() > 1e-2
                checked += int(active.sum())
    assert checked > 20, checked
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"SAMPLING_MASK_TRAINER_TP_OK tokens={checked}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
