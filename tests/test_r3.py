"""R3 routing replay: the trainer uses exactly the rollout engine's experts, never silently its
own; payload alignment and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist.r3_common import make_samples
from transformers import AutoModelForCausalLM

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.models import build_gpt_model, transformer_config_from_hf
from megatron_sat.rollout.types import Sample
from megatron_sat.routing.payload import (
    decode_routed_experts,
    encode_routed_experts,
    extend_routed_experts,
)
from megatron_sat.routing.replay import (
    MicroBatchRoutes,
    RoutingReplay,
    capture_routing,
    find_routers,
    replay_routing,
)
from megatron_sat.routing.slicing import moe_layer_numbers, router_targets
from megatron_sat.training.batching import build_micro_batch, check_sample_routes, filler_routes
from megatron_sat.training.logprobs import forward_backward, forward_log_probs, routing_agreement
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
    # Any 4 consecutive rows give each of 2 EP ranks (experts 0-3, 4-7) the same load.
    ep_rank = filler_routes(40, top_k=2, num_experts=8, start=3) // 4
    assert all((ep_rank[i : i + 4] == 0).sum() == 4 for i in range(0, 40, 4))
    with pytest.raises(ValueError, match="top_k=9 > num_experts=8"):
        filler_routes(1, top_k=9, num_experts=8)


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


# ----------------------------------------------------------------------------------------------
# RoutingReplay on small megatron-core models built here (no HF checkpoint needed)

HF4 = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=128,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)


def build_model(hf_config, mtp: bool = False, **overrides):
    """A fresh GPTModel (local spec) on the 1-process world; MTP block when ``mtp``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    if mtp:
        overrides["mtp_num_layers"] = 1
    overrides.setdefault("calculate_per_token_loss", True)
    config = transformer_config_from_hf(hf_config, **overrides)
    torch.manual_seed(0)
    if not mtp:
        return build_gpt_model(hf_config, config, use_transformer_engine=False)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=hf_config["vocab_size"],
        max_sequence_length=128,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec.layer_specs[-1], False),
        position_embedding_type="rope",
    )


def routing_shape(hf_config):
    return (hf_config["num_hidden_layers"], hf_config["num_experts_per_tok"], 8)


def as_map(indices: torch.Tensor, num_experts: int = 8) -> torch.Tensor:
    return torch.zeros(indices.shape[0], num_experts, dtype=torch.bool).scatter_(1, indices, True)


def replay_forward(model, batch, *, capture=True, training=False, audit=True):
    controller = RoutingReplay(model)
    routes = {0: controller.routes_for(batch.routes, batch.routes_valid)}
    with controller.replay(routes, training=training, capture=capture, audit=audit) as report:
        with controller.micro_batch(0):
            log_probs = forward_log_probs(model, batch)
    return controller, routes[0], report, log_probs


@pytest.mark.parametrize(
    ("pattern", "moe_layers"),
    [({"mlp_only_layers": [0, 1]}, [3, 4]), ({"decoder_sparse_step": 2}, [2, 4])],
    ids=["first-k-dense (DeepSeek-V3-like)", "hybrid dense/MoE"],
)
def test_dense_layouts_map_every_moe_layer_to_its_own_rows(megatron_world, pattern, moe_layers):
    hf = dict(HF4, **pattern)
    model = build_model(hf)
    assert model.config.moe_layer_freq == [int(n in moe_layers) for n in range(1, 5)]
    samples = make_samples([(4, 5), (3, 2)], hf)
    mb = build_micro_batch(samples, [1.0, 1.0], pad_token_id=0, routing_shape=routing_shape(hf))
    controller, routes, report, _ = replay_forward(model, mb)
    assert controller.layers == moe_layers
    for layer in moe_layers:
        used = report.used[(0, layer)]
        own_rows = mb.routes[:, :, layer - 1].transpose(0, 1).reshape(-1, 2).long()
        assert torch.equal(used, as_map(own_rows))  # every token, filler rows included
        other = mb.routes[:, :, layer - 2].transpose(0, 1).reshape(-1, 2).long()
        assert not torch.equal(used, as_map(other))  # not a neighbour's rows
    assert sorted(report.forwards) == moe_layers  # dense layers have no router to replay
    # A payload with the wrong layer count is refused, counts named.
    with pytest.raises(ValueError, match="routes have 3 layers but the model has num_layers=4"):
        controller.routes_for(mb.routes[:, :, :3], mb.routes_valid)
    with pytest.raises(ValueError, match=r"it has 3 layers, the model has 4"):
        samples[0].routed_experts = samples[0].routed_experts[:, :3]
        build_micro_batch(samples, [1.0, 1.0], pad_token_id=0, routing_shape=routing_shape(hf))


def test_dense_layers_rows_of_expert_zero_are_not_checked(megatron_world):
    # SGLang 0.5.23 leaves a dense layer's routed_experts rows at its zero-initialised buffer
    # (expert 0, top_k times): only the MoE layers' rows must be distinct, in-range ids.
    hf = dict(HF4, mlp_only_layers=[0, 2])
    config = transformer_config_from_hf(hf)
    assert moe_layer_numbers(config) == [2, 4]
    assert moe_layer_numbers(transformer_config_from_hf(HF4)) == [1, 2, 3, 4]
    samples = make_samples([(4, 3), (2, 2)], hf)
    for s in samples:
        s.routed_experts[:, [0, 2]] = 0
    mb = build_micro_batch(
        samples, [1.0, 1.0], pad_token_id=0, routing_shape=(4, 2, 8), moe_layers=[2, 4]
    )
    assert torch.equal(mb.routes[0, :6, 0], torch.zeros(6, 2, dtype=torch.uint8))
    targets = mb.routing_targets([2, 4])
    assert torch.equal(targets[4][0], torch.from_numpy(samples[0].routed_experts[0, 3]).long())
    # Without the MoE layers named, the dense layer's zeros are refused (layer 0 of the payload).
    with pytest.raises(ValueError, match=r"sample 0: routed_experts row 0, layer 0 names one"):
        build_micro_batch(samples, [1.0, 1.0], pad_token_id=0, routing_shape=(4, 2, 8))
    # A repeat on an MoE layer is still named, by its payload layer index.
    samples[1].routed_experts[1, 3] = [5, 5]
    with pytest.raises(ValueError, match=r"sample 1: routed_experts row 1, layer 3 names one"):
        check_sample_routes(samples[1], 4, 2, 8, moe_layers=[2, 4])
    samples[1].routed_experts[1, 3] = [5, 9]
    with pytest.raises(ValueError, match=r"sample 1: routed_experts ids outside \[0, 8\)"):
        check_sample_routes(samples[1], 4, 2, 8, moe_layers=[2, 4])
    with pytest.raises(ValueError, match=r"moe_layers \[5\] outside \[1, num_layers=4\]"):
        check_sample_routes(samples[0], 4, 2, 8, moe_layers=[2, 5])
    # A router on a layer the config calls dense would read a dense layer's rows: refused.
    model = build_model(HF4)
    model.config.moe_layer_freq = [0, 1, 1, 1]  # the routers share this config object
    with pytest.raises(ValueError, match=r"routers on layers \[1\], which moe_layer_freq"):
        RoutingReplay(model)


def test_qwen3_moe_layer_pattern_errors():
    from megatron_sat.models.qwen3_moe import moe_layer_pattern

    assert moe_layer_pattern(dict(HF4, decoder_sparse_step=2, mlp_only_layers=[3])) == [0, 1, 0, 0]
    with pytest.raises(ValueError, match="decoder_sparse_step=0"):
        moe_layer_pattern(dict(HF4, decoder_sparse_step=0))
    with pytest.raises(ValueError, match=r"mlp_only_layers \[4\] outside"):
        moe_layer_pattern(dict(HF4, mlp_only_layers=[4]))
    with pytest.raises(ValueError, match="no MoE layer"):
        transformer_config_from_hf(dict(HF4, mlp_only_layers=[0, 1, 2, 3]))


def test_mtp_layers_never_receive_decoder_routes(megatron_world):
    hf = dict(HF4, num_hidden_layers=2)
    model = build_model(hf, mtp=True)
    controller = RoutingReplay(model)
    # The MTP layer's router numbers itself 1 again; it is kept apart from decoder layer 1.
    assert controller.layers == [1, 2] and list(controller.mtp_routers) == [1]
    mtp_router = controller.mtp_routers[1]
    seen = {}

    def hook(module, args, output):
        seen["action"] = module.router_replay.router_replay_action
        seen["target"] = module.router_replay.target_topk_idx
        logits = args[0].reshape(-1, args[0].shape[-1]) @ module.weight.t()
        seen["live"] = as_map(logits.topk(2, dim=1).indices)
        seen["used"] = output[1]

    handle = mtp_router.register_forward_hook(hook)
    mb = build_micro_batch(
        make_samples([(4, 4)], hf), [1.0], pad_token_id=0, routing_shape=routing_shape(hf)
    )
    try:
        _, routes, report, _ = replay_forward(model, mb)
    finally:
        handle.remove()
    assert seen["action"] is None and seen["target"] is None
    assert torch.equal(seen["used"], seen["live"])  # the MTP router routed live
    for layer in (1, 2):
        assert torch.equal(report.used[(0, layer)], as_map(routes.targets[layer]))


def test_model_built_twice_replays_only_the_live_one(megatron_world):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    first = build_model(HF4)
    before = len(RouterReplay.global_router_replay_instances)
    second = build_model(HF4)
    assert len(RouterReplay.global_router_replay_instances) == before + 4  # stale ones stay
    mb = build_micro_batch(
        make_samples([(5, 6), (2, 4)], HF4), [1.0, 1.0], pad_token_id=0, routing_shape=(4, 2, 8)
    )
    controller, routes, report, _ = replay_forward(second, mb)
    for layer in range(1, 5):
        assert torch.equal(report.used[(0, layer)], as_map(routes.targets[layer]))
    assert all(r.router_replay.router_replay_action is None for r in find_routers(first).values())
    # A forward of the first model during a session of the second routes live, undisturbed.
    with controller.replay({0: routes}, training=False), capture_routing(first) as used:
        forward_log_probs(first, mb)
    assert not torch.equal(used[1], as_map(routes.targets[1]))


def test_missing_targets_and_misuse_raise(megatron_world):
    model = build_model(HF4)
    controller = RoutingReplay(model)
    mb = build_micro_batch(
        make_samples([(3, 3)], HF4), [1.0], pad_token_id=0, routing_shape=(4, 2, 8)
    )
    routes = controller.routes_for(mb.routes, mb.routes_valid)
    partial = MicroBatchRoutes({k: v for k, v in routes.targets.items() if k != 3}, routes.real)
    with pytest.raises(ValueError, match=r"micro-batch 0 .* missing \[3\]"):
        with controller.replay({0: partial}):
            pass
    with controller.replay({0: routes}, training=False):
        with pytest.raises(ValueError, match="no routing replay targets for micro-batch 1"):
            with controller.micro_batch(1):
                pass
        with pytest.raises(RuntimeError, match="outside RoutingReplay.micro_batch"):
            forward_log_probs(model, mb)
    shorter = MicroBatchRoutes({k: v[:-2] for k, v in routes.targets.items()})
    with pytest.raises(ValueError, match="has 4 rows but the router sees 6 tokens"):
        with controller.replay({0: shorter}, training=False), controller.micro_batch(0):
            forward_log_probs(model, mb)
    outside = {**routes.targets, 4: routes.targets[4].clone().fill_(8)}
    with pytest.raises(ValueError, match=r"layer 4 holds expert ids outside \[0, 8\)"):
        with controller.replay({0: MicroBatchRoutes(outside)}):
            pass
    twice = {**routes.targets, 2: routes.targets[2][:, [0, 0]]}
    with pytest.raises(ValueError, match="layer 2 repeats an expert"):
        with controller.replay({0: MicroBatchRoutes(twice)}):
            pass
    # Nothing is left installed after the errors.
    assert all(r.router_replay.target_topk_idx is None for r in controller.routers.values())


def test_unsupported_router_settings_are_refused(megatron_world):
    model = build_model(HF4)
    try:
        model.config.moe_router_fusion = True
        with pytest.raises(
            ValueError, match=r"layer 1 cannot be exact with \['moe_router_fusion'\]"
        ):
            RoutingReplay(model)
    finally:
        model.config.moe_router_fusion = False
    no_replay = build_model(HF4, moe_enable_routing_replay=False)
    with pytest.raises(ValueError, match="has no RouterReplay"):
        RoutingReplay(no_replay)


def test_record_then_replay_after_the_policy_moved_and_audit(megatron_world):
    model = build_model(HF4)
    mb = build_micro_batch(
        make_samples([(6, 6), (4, 3)], HF4), [1.0, 1.0], pad_token_id=0, routing_shape=(4, 2, 8)
    )
    controller = RoutingReplay(model)
    with controller.record(training=False) as recorded, controller.micro_batch(0):
        forward_log_probs(model, mb)
    assert sorted(recorded.recorded) == [(0, n) for n in range(1, 5)]
    # Replaying the model's own choice: the audit finds no difference.
    own = MicroBatchRoutes(
        {layer: recorded.recorded[(0, layer)] for layer in range(1, 5)},
        real=controller.routes_for(mb.routes, mb.routes_valid).real,
    )
    with controller.replay({0: own}, training=False) as report, controller.micro_batch(0):
        forward_log_probs(model, mb)
    assert report.metrics(4)["r3_topk_differ"] == 0.0
    # The policy moves; replay still uses the recorded experts, and the audit counts exactly the
    # real tokens whose own top-k (from the router's input, by hand) differs from them.
    router_inputs = {}
    hooks = [
        r.register_forward_pre_hook(lambda m, a, n=n: router_inputs.__setitem__(n, a[0]))
        for n, r in controller.routers.items()
    ]
    with torch.no_grad():
        for router in controller.routers.values():
            router.weight.add_(torch.randn_like(router.weight))
    try:
        with controller.replay({0: own}, training=False, capture=True) as report:
            with controller.micro_batch(0):
                forward_log_probs(model, mb)
    finally:
        for h in hooks:
            h.remove()
    metrics = report.metrics(4)
    for layer, router in controller.routers.items():
        assert torch.equal(report.used[(0, layer)], as_map(own.targets[layer]))
        x = router_inputs[layer].reshape(-1, 32)
        hand = as_map((x @ router.weight.t()).topk(2, dim=1).indices)
        differ = (hand != as_map(own.targets[layer])).any(dim=1)[own.real].float().mean()
        assert metrics[f"r3_topk_differ_layer{layer}"] == pytest.approx(float(differ))
    assert 0.0 < metrics["r3_topk_differ"] < 1.0


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_gates_come_from_the_trainers_full_scores(megatron_world, norm_topk_prob):
    model = build_model(dict(HF4, norm_topk_prob=norm_topk_prob))
    mb = build_micro_batch(
        make_samples([(5, 5)], HF4), [1.0], pad_token_id=0, routing_shape=(4, 2, 8)
    )
    router = find_routers(model)[2]
    seen = {}

    def hook(module, args, output):
        seen["x"], seen["probs"] = args[0].detach(), output[0].detach()

    handle = router.register_forward_hook(hook)
    try:
        _, routes, _, _ = replay_forward(model, mb)
    finally:
        handle.remove()
    logits = seen["x"].reshape(-1, 32) @ router.weight.detach().t()
    target = routes.targets[2]
    if norm_topk_prob:  # softmax over the trainer's logits at the replayed experts
        gates = torch.softmax(logits.gather(1, target), dim=1)
    else:  # the trainer's full softmax, read at the replayed experts (not renormalised)
        gates = torch.softmax(logits, dim=1).gather(1, target)
    expected = torch.zeros_like(logits).scatter(1, target, gates)
    torch.testing.assert_close(seen["probs"], expected, rtol=1e-6, atol=1e-7)


def test_packed_rows_equal_padded_samples_and_isolate_them(megatron_world):
    from megatron_sat.training.packing import pack_micro_batches

    model = build_model(HF4)
    samples = make_samples([(4, 6), (3, 2), (6, 5), (2, 7)], HF4)
    adv = [1.0, -1.0, 0.5, 2.0]
    padded = build_micro_batch(samples, adv, pad_token_id=0, routing_shape=(4, 2, 8))
    packed = pack_micro_batches(
        samples, adv, pad_token_id=0, max_tokens_per_row=24, routing_shape=(4, 2, 8)
    )
    # First fit in order into rows of 24: [10, 5, 9] tokens and [11].
    assert [p.samples.sample_indices for p in packed] == [[0, 1, 3], [2]]
    _, _, pad_report, pad_lp = replay_forward(model, padded)
    mask = padded.loss_mask.bool()
    for p in packed:
        _, routes, report, lp = replay_forward(model, p)
        assert report.metrics(4)["r3_topk_differ"] > 0.5  # random routes really replayed
        for layer in range(1, 5):
            assert torch.equal(report.used[(0, layer)], as_map(routes.targets[layer]))
        rows = p.samples.sample_indices
        seq = min(lp.shape[1], pad_lp.shape[1])
        sel = mask[rows, :seq]
        assert sel.sum() == p.samples.loss_mask.sum()
        torch.testing.assert_close(lp[:, :seq][sel], pad_lp[rows, :seq][sel], rtol=0, atol=2e-6)
    # Block-diagonal attention: changing sample 0's tokens leaves samples 1 and 3 (same row)
    # unchanged.
    first = packed[0]
    changed = [dict_replace(samples[0], prompt_ids=[9] * 4), samples[1], samples[3]]
    other = pack_micro_batches(
        changed,
        [adv[0], adv[1], adv[3]],
        pad_token_id=0,
        max_tokens_per_row=24,
        routing_shape=(4, 2, 8),
    )[0]
    _, _, _, lp_a = replay_forward(model, first)
    _, _, _, lp_b = replay_forward(model, other)
    assert torch.equal(lp_a[1:], lp_b[1:]) and not torch.equal(lp_a[0], lp_b[0])
    # Routes go through the tokens' index map: packed row 0 = sample 0's rows, filler at its end.
    assert torch.equal(
        first.routes[0, :9].long(), torch.from_numpy(samples[0].routed_experts).long()
    )
    assert first.routes_valid[0, :11].tolist() == [True] * 9 + [False] + [True]


def dict_replace(sample, **changes):
    import dataclasses

    return dataclasses.replace(sample, **changes)


def test_router_targets_follow_sequence_parallel_shards():
    routes = (torch.arange(2)[:, None] * 10 + torch.arange(4)[None, :]).view(2, 4, 1, 1)
    full = router_targets(routes, [1], num_layers=1)[1].view(-1).tolist()
    assert full == [0, 10, 1, 11, 2, 12, 3, 13]  # sequence-major: row s * B + b
    shard = router_targets(routes, [1], num_layers=1, tp_rank=1, tp_size=2, sequence_parallel=True)
    assert shard[1].view(-1).tolist() == [2, 12, 3, 13]  # TP rank 1 holds positions 2 and 3
    with pytest.raises(ValueError, match="sequence length 4 is not divisible by the TP size 3"):
        router_targets(routes, [1], num_layers=1, tp_rank=0, tp_size=3, sequence_parallel=True)


def test_incremental_payload_rows_and_wrong_layer_count():
    rows = np.arange(5 * 3 * 2).reshape(5, 3, 2) % 8
    first = decode_routed_experts(
        encode_routed_experts(rows[:3]), num_tokens=3, num_layers=3, top_k=2, num_experts=8
    )
    more = decode_routed_experts(
        encode_routed_experts(rows[3:]), num_tokens=2, num_layers=3, top_k=2, num_experts=8
    )
    merged = extend_routed_experts(first, more, start_len=3, num_experts=8)
    assert merged.dtype == np.uint8 and np.array_equal(merged, rows)
    with pytest.raises(ValueError, match="routed_experts_start_len=2 but 3 rows are held"):
        extend_routed_experts(first, more, start_len=2, num_experts=8)
    with pytest.raises(ValueError, match=r"or 2 layers for 5 tokens .* num_hidden_layers=3"):
        decode_routed_experts(
            encode_routed_experts(rows[:, :2]), num_tokens=5, num_layers=3, top_k=2, num_experts=8
        )
    assert extend_routed_experts(None, more, start_len=0, num_experts=300).dtype == np.int16


def test_cpu_shim_builds_torch_norms_under_sequence_parallel():
    from types import SimpleNamespace

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if torch.cuda.is_available():
        pytest.skip("shims apply only without CUDA")
    config = SimpleNamespace(
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        sequence_parallel=True,
        memory_efficient_layer_norm=False,
        normalization="RMSNorm",
    )
    norm = WrappedTorchNorm(config, 8, 1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and config.sequence_parallel
    assert all(p.sequence_parallel for p in norm.parameters())
    from megatron.core.tensor_parallel import random as tp_random

    assert tp_random._get_cuda_rng_state().numel() == 0  # recompute saves no CUDA RNG state


def test_forward_backward_refuses_rescaling_configs(megatron_world):
    model = build_model(HF4, calculate_per_token_loss=False)
    mb = build_micro_batch(make_samples([(3, 3)], HF4), [1.0], pad_token_id=0)
    with pytest.raises(ValueError, match="calculate_per_token_loss=True"):
        forward_backward([model], [mb], lambda lp, b, i: (lp.sum(), {}))


def test_packed_rope_follows_position_ids(megatron_world):
    from megatron_sat.training.packing import pack_micro_batches, use_position_ids_for_rope

    model = build_model(HF4)
    samples = make_samples([(4, 6), (3, 2)], HF4)
    packed = pack_micro_batches(samples, [1.0, 1.0], pad_token_id=0, max_tokens_per_row=24)[0]
    assert packed.position_ids[0, 9:12].tolist() == [9, 0, 1]  # sample 1 starts at 10
    seen = []
    use_position_ids_for_rope(model)
    use_position_ids_for_rope(model)  # idempotent: one pair of hooks
    handle = model.decoder.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["rotary_pos_emb"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(packed.input_ids, packed.position_ids, packed.attention_mask)
            model(packed.input_ids, None, packed.attention_mask)  # no positions: megatron's own
    finally:
        handle.remove()
    per_token, default = seen
    assert per_token.shape == (15, 1, 1, 8) and default.shape == (15, 1, 1, 8)
    table = model.rotary_pos_emb.get_emb(15)
    for t in range(15):  # bitwise the rotation of the token's own position
        assert torch.equal(per_token[t, 0], table[int(packed.position_ids[0, t]), 0])
    assert not torch.equal(default[10], default[0]) and torch.equal(per_token[10], default[0])


def test_recompute_reuses_its_own_micro_batchs_routes(megatron_world):
    # Full recompute on one rank: a no-grad forward of micro-batch 1 inside the training
    # session must not enter the recompute FIFO, or micro-batch 0's recompute would replay it.
    model = build_model(HF4, recompute_granularity="full")
    controller = RoutingReplay(model)
    mbs = [
        build_micro_batch(
            make_samples([(4, 4), (3, 5)], HF4, seed=seed),
            [1.0, 1.0],
            pad_token_id=0,
            routing_shape=(4, 2, 8),
        )
        for seed in (0, 1)
    ]
    routes = {i: controller.routes_for(mb.routes, mb.routes_valid) for i, mb in enumerate(mbs)}
    with controller.replay(routes, training=True, capture=True) as report:
        with torch.no_grad(), controller.micro_batch(1):
            forward_log_probs(model, mbs[1])
        with controller.micro_batch(0):
            log_probs = forward_log_probs(model, mbs[0])
        (log_probs * mbs[0].loss_mask).sum().backward()
    assert report.recomputes == {layer: 1 for layer in range(1, 5)}
    for layer in range(1, 5):
        assert torch.equal(report.recomputed[(0, layer)], as_map(routes[0].targets[layer]))
        assert torch.equal(report.used[(0, layer)], report.recomputed[(0, layer)])
    # A recompute in a forward-only session is refused.
    with pytest.raises(RuntimeError, match="recomputed inside a forward-only session"):
        with controller.replay(routes, training=False), controller.micro_batch(0):
            log_probs = forward_log_probs(model, mbs[0])
            log_probs.sum().backward()


def _grads_after(model, controller, routes, mbs, order):
    """Forward every micro-batch in index order inside one training session, then backward
    them in ``order``; the accumulated gradients (cloned) and the session's report."""
    model.zero_grad(set_to_none=True)
    with controller.replay(routes, training=True, capture=True) as report:
        losses = []
        for i, mb in enumerate(mbs):
            with controller.micro_batch(i):
                losses.append((forward_log_probs(model, mb) * mb.loss_mask).sum())
        for i in order:
            losses[i].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, report


def test_out_of_order_backward_recomputes_each_micro_batchs_own_routes(megatron_world):
    # F0, F1, B1, B0 under full recompute: B1's recompute must replay micro-batch 1's routes
    # (megatron-core's per-layer FIFO would hand it micro-batch 0's). The gradients must be
    # those of the in-order backward (F0, F1, B0, B1), bitwise: fp32 sums of two terms commute.
    model = build_model(HF4, recompute_granularity="full")
    controller = RoutingReplay(model)
    mbs = [
        build_micro_batch(
            make_samples([(4, 4), (3, 5)], HF4, seed=seed),
            [1.0, -1.0],
            pad_token_id=0,
            routing_shape=(4, 2, 8),
        )
        for seed in (0, 1)
    ]  # same shapes: a wrong pop would not be caught by a token count
    routes = {i: controller.routes_for(mb.routes, mb.routes_valid) for i, mb in enumerate(mbs)}
    in_order, _ = _grads_after(model, controller, routes, mbs, [0, 1])
    swapped, report = _grads_after(model, controller, routes, mbs, [1, 0])
    assert report.recomputes == {layer: 2 for layer in range(1, 5)}
    for (mb, layer), recomputed in report.recomputed.items():
        assert torch.equal(recomputed, as_map(routes[mb].targets[layer])), (mb, layer)
    assert in_order.keys() == swapped.keys()
    for name, grad in in_order.items():
        assert torch.equal(swapped[name], grad), name
    # One backward through both losses: each block output's hook still names the micro-batch
    # whose recomputes follow (autograd runs micro-batch 1's later nodes first).
    model.zero_grad(set_to_none=True)
    with controller.replay(routes, training=True) as report:
        losses = []
        for i, mb in enumerate(mbs):
            with controller.micro_batch(i):
                losses.append((forward_log_probs(model, mb) * mb.loss_mask).sum())
        (losses[0] + losses[1]).backward()
    assert report.recomputes == {layer: 2 for layer in range(1, 5)}
    for name, param in model.named_parameters():
        if name in in_order:
            torch.testing.assert_close(param.grad, in_order[name], rtol=1e-6, atol=0)


def test_routes_must_be_distinct_integer_ids_and_advantages_finite(tiny_checkpoint, trainer):
    sample = rollout_samples(tiny_checkpoint, [(3, 2)])[0]
    good = sample.routed_experts
    sample.routed_experts = good.astype(np.float32) + 0.7
    with pytest.raises(ValueError, match="sample 0: routed_experts must be an integer numpy"):
        build_micro_batch([sample], [0.0], pad_token_id=0, routing_shape=trainer.routing_shape)
    sample.routed_experts = good.copy()
    sample.routed_experts[1, 0] = [3, 3]
    with pytest.raises(ValueError, match=r"row 1, layer 0 names one expert twice: \[3, 3\]"):
        build_micro_batch([sample], [0.0], pad_token_id=0, routing_shape=trainer.routing_shape)
    sample.routed_experts = good
    with pytest.raises(ValueError, match="sample 0: advantage nan is not finite"):
        build_micro_batch([sample], [float("nan")], pad_token_id=0)
