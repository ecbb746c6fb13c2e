"""torchrun (2 gloo ranks): ``truncated_log_probs_tp`` with each rank holding half the
vocabulary equals the full-vocabulary ``objectives.sampling_mask.truncated_log_probs`` (values
and gradients), for several (temperature, top_p, top_k), ties across the shard border
included. Ties at the boundary are kept in ascending vocabulary order (a stable sort's; see
``training.sampling_mask_tp``), so the reference here is the full-vocabulary formula with
``kept_mask``'s rule on a stable sort. Prints ``SAMPLING_MASK_TP_OK`` on rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sat.training.sampling_mask_tp import SamplingMask, truncated_log_probs_tp

CASES = [(1.0, 0.9, -1), (0.7, 0.5, -1), (1.0, 1.0, 5), (1.3, 0.8, 20), (1.0, 0.45, 8)]


def stable_reference(logits, labels, temperature, top_p, top_k):
    """``objectives.sampling_mask.truncated_log_probs`` with its sort made stable."""
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    with torch.no_grad():
        probs, order = log_probs.exp().sort(dim=-1, descending=True, stable=True)
        keep = probs.cumsum(dim=-1) - probs <= top_p
        if top_k > 0:
            keep &= torch.arange(probs.shape[-1]) < top_k
        kept = torch.zeros_like(keep).scatter_(-1, order, keep)
        kept.scatter_(1, labels[:, None], True)
    chosen = log_probs.gather(1, labels[:, None]).squeeze(1)
    return chosen - torch.logsumexp(log_probs.masked_fill(~kept, float("-inf")), dim=-1)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    vocab = 300
    shard = vocab // world
    for case, (temperature, top_p, top_k) in enumerate(CASES):
        gen = torch.Generator().manual_seed(case)  # same full logits on every rank
        logits = torch.randn(48, vocab, generator=gen) * 3
        logits[:8, shard - 6 : shard + 4] = 9.0  # 10 tied leaders across the shard border
        labels = torch.randint(0, vocab, (48,), generator=gen)
        weights = torch.randn(48, generator=gen)
        full = logits.clone().requires_grad_()
        ref = stable_reference(full, labels, temperature, top_p, top_k)
        (ref * weights).sum().backward()
        mine = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
        got = truncated_log_probs_tp(mine, labels, SamplingMask(temperature, top_p, top_k), group)
        (got * weights).sum().backward()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            mine.grad, full.grad[:, rank * shard : (rank + 1) * shard], rtol=1e-5, atol=1e-6
        )
    dist.barrier()
    if rank == 0:
        print("SAMPLING_MASK_TP_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
