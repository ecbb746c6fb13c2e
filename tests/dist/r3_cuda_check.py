"""R3 replay on a CUDA device (one process, NCCL world of 1, local spec, no CPU shims): a check to
run by hand on a GPU machine; CI has no GPU.

    python tests/dist/r3_cuda_check.py

On packed micro-batches moved to the GPU: replay uses the targets for 100% of real tokens, the
audit's counts reduce over NCCL, full recompute under megatron-core's schedule replays each
micro-batch's own routes and gives the gradients of the run without recompute. Prints one JSON
line ``R3_CUDA {...}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from r3_common import HF_CONFIG, make_samples, nll_loss


def main() -> None:
    from megatron_sat.models import build_gpt_model, transformer_config_from_hf
    from megatron_sat.platform import apply_cpu_shims
    from megatron_sat.routing.replay import RoutingReplay
    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.training.logprobs import forward_backward
    from megatron_sat.training.packing import pack_micro_batches

    assert torch.cuda.is_available()
    init_distributed(ParallelConfig())
    hf = dict(HF_CONFIG, mlp_only_layers=[0])
    samples = make_samples([(5, 9), (3, 7), (6, 4), (4, 8), (7, 6), (2, 9), (5, 5)], hf)
    mbs = pack_micro_batches(
        samples,
        torch.linspace(-1, 1, len(samples)),
        pad_token_id=0,
        max_tokens_per_row=40,
        routing_shape=(4, 2, 8),
    )
    mbs = [mb.to("cuda") for mb in mbs]
    num_tokens = float(sum(mb.samples.loss_mask.sum() for mb in mbs))
    result = {"shims_applied": apply_cpu_shims(), "micro_batches": len(mbs)}
    grads = {}
    for recompute in (None, "full"):
        config = transformer_config_from_hf(
            hf, recompute_granularity=recompute, calculate_per_token_loss=True
        )
        torch.manual_seed(0)
        model = build_gpt_model(hf, config, use_transformer_engine=False).cuda()
        controller = RoutingReplay(model)
        routes = {i: controller.routes_for(mb.routes, mb.routes_valid) for i, mb in enumerate(mbs)}
        with controller.replay(routes, training=True, capture=True) as report:
            out = forward_backward([model], mbs, nll_loss(num_tokens), replay=controller)
        key = recompute or "none"
        hit = total = rhit = 0
        for (mb, layer), used in report.used.items():
            want = torch.zeros_like(used).scatter_(1, routes[mb].targets[layer], True)
            real = routes[mb].real
            hit += int((used == want).all(1)[real].sum())
            total += int(real.sum())
            if (mb, layer) in report.recomputed:
                rhit += int((report.recomputed[(mb, layer)] == want).all(1)[real].sum())
        result[f"{key}_forward_match"] = hit / total
        result[f"{key}_recompute_match"] = rhit / total if report.recomputed else None
        result[f"{key}_recomputes"] = sum(report.recomputes.values())
        result[f"{key}_loss"] = sum(float(o["loss"]) for o in out)
        result[f"{key}_metrics"] = report.metrics(4)
        result[f"{key}_device"] = str(routes[0].targets[2].device)
        grads[key] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    result["grad_max_abs_diff"] = max(
        float((grads["none"][n] - grads["full"][n]).abs().max()) for n in grads["none"]
    )
    print("R3_CUDA " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
