"""R3 routing replay: the trainer uses exactly the rollout engine's experts, never silently its
own; payload alignment and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_sat.config import TrainConfig
from megatron_sat.rollout.types import Sample
from megatron_sat.routing.replay import capture_routing, replay_routing
from megatron_sat.training.batching import build_micro_batch, filler_routes
from megatron_sat.training.distributed import ParallelConfig
from megatron_sat.training.logprobs import forward_log_probs, routing_agreement
from megatron_sat.training.trainer import PolicyTrainer


def rollout_samples(checkpoint, lengths, seed=0):
    """Samples whose routes come from a transformers forward (the 'rollout engine')."""
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(3, 99, (1, p + r), generator=gen)
        routes = []
        hooks = [
            layer.mlp.gate.register_forward_hook(
                lambda m, a, out, routes=routes: routes.append(out[2].detach())
            )
            for layer in hf.model.layers
        ]
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(ids).logits[0], -1)
        for h in hooks:
            h.remove()
        routed = torch.stack(routes, dim=1)[:-1].numpy().astype(np.uint8)  # [P+R-1, L, K]
        tokens = ids[0].tolist()
        lp = [float(log_probs[t - 1, tokens[t]]) for t in range(p, p + r)]
        samples.append(
            Sample(
                index=i,
                group_index=i,
                prompt="",
                label="",
                prompt_ids=tokens[:p],
                response_ids=tokens[p:],
                rollout_log_probs=lp,
                response_versions=[0] * r,
                routed_experts=routed,
            )
        )
    return samples


@pytest.fixture(scope="module")
def trainer(megatron_world, tiny_checkpoint, tiny_hf_config):
    return PolicyTrainer(
        tiny_hf_config,
        TrainConfig(micro_batch_size=4),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )


def test_replay_reproduces_rollout_routes_after_perturbation(trainer, tiny_checkpoint):
    samples = rollout_samples(tiny_checkpoint, [(5, 7), (3, 11), (9, 2)])
    mb = build_micro_batch(
        samples, [1.0, -1.0, 0.5], pad_token_id=0, routing_shape=trainer.routing_shape
    )
    model = trainer.model
    # Before perturbation the trainer's live routing agrees with the rollout's everywhere.
    with torch.no_grad(), capture_routing(model) as used:
        forward_log_probs(model, mb)
    assert routing_agreement(used, mb)["topk_match"].item() == 1.0
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "router" in n}
    try:
        with torch.no_grad():  # the policy moves after the rollout
            for name, param in model.named_parameters():
                if "router" in name:
                    param.add_(torch.randn_like(param))
        with torch.no_grad(), capture_routing(model) as used:
            forward_log_probs(model, mb)
        live = routing_agreement(used, mb)["topk_match"].item()
        with replay_routing(model, mb.routing_targets()), capture_routing(model) as used:
            log_probs = forward_log_probs(model, mb)
            (log_probs * mb.loss_mask).sum().backward()
        replayed = routing_agreement(used, mb)
        router_grad = [
            float(p.main_grad.abs().sum()) for n, p in model.named_parameters() if "router" in n
        ]
    finally:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in saved:
                    param.copy_(saved[name])
        model.zero_grad_buffer()
    assert live < 0.9
    assert replayed["topk_match"].item() == 1.0
    assert all(replayed[f"topk_match_layer{layer}"].item() == 1.0 for layer in (1, 2))
    # Gates are recomputed from the trainer's logits: the router still gets a gradient.
    assert all(g > 0 for g in router_grad)


def test_filler_rows_are_valid_distinct_and_spread():
    rows = filler_routes(8, top_k=2, num_experts=8)
    assert rows.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3], [4, 5], [6, 7]]


def test_routes_follow_the_token_layout(tiny_checkpoint, trainer):
    samples = rollout_samples(tiny_checkpoint, [(2, 2), (4, 3)])
    mb = build_micro_batch(samples, [0.0, 0.0], pad_token_id=0, routing_shape=trainer.routing_shape)
    # Row b, position t holds token t's routes; the last real token and padding get filler.
    assert torch.equal(mb.routes[0, :3], torch.from_numpy(samples[0].routed_experts).long())
    assert mb.routes_valid[0].tolist() == [True, True, True, False, False, False, False]
    targets = mb.routing_targets()
    assert targets[1].shape == (7 * 2, 2)
    # Sequence-major: row s * B + b.
    assert torch.equal(targets[2][3 * 2 + 1], mb.routes[1, 3, 1])


def test_wrong_payload_shape_names_sample_and_counts(tiny_checkpoint, trainer):
    sample = rollout_samples(tiny_checkpoint, [(3, 4)])[0]
    sample.routed_experts = sample.routed_experts[:, :1]
    with pytest.raises(
        ValueError,
        match=r"sample 0: routed_experts has shape \(6, 1, 2\), "
        r"expected \(6, 2, 2\)",
    ):
        build_micro_batch([sample], [0.0], pad_token_id=0, routing_shape=trainer.routing_shape)
    sample.routed_experts = None
    with pytest.raises(ValueError, match="sample 0 has no routed_experts"):
        build_micro_batch([sample], [0.0], pad_token_id=0, routing_shape=trainer.routing_shape)


def test_missing_layer_target_raises_instead_of_live_routing(tiny_checkpoint, trainer):
    mb = build_micro_batch(
        rollout_samples(tiny_checkpoint, [(3, 3)]),
        [0.0],
        pad_token_id=0,
        routing_shape=trainer.routing_shape,
    )
    targets = mb.routing_targets()
    del targets[2]
    with pytest.raises(ValueError, match=r"missing \[2\]"):
        with replay_routing(trainer.model, targets):
            pass
    targets = mb.routing_targets()
    targets[1] = targets[1][:, :1]
    with pytest.raises(ValueError, match="layer 1 has shape"):
        with replay_routing(trainer.model, targets):
            pass
