"""Token-budget micro-batches (training/micro_batches.py) and context-parallel slicing
(training/context_parallel.py): hand-computed groupings, the budget invariant, the refusals,
and CP2 slicing of tokens, routes and loss masks that reassembles to the unsplit micro-batch
bit for bit (a misplaced chunk does not), checked against megatron-core's own split."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_sat.config import ParallelConfig
from megatron_sat.platform.distributed import init_distributed
from megatron_sat.rollout.types import Sample
from megatron_sat.training.batching import build_micro_batch
from megatron_sat.training.context_parallel import (
    SEQUENCE_FIELDS,
    context_parallel_positions,
    reassemble_context_parallel,
    reassemble_micro_batch_context_parallel,
    slice_context_parallel,
    slice_micro_batch_context_parallel,
)
from megatron_sat.training.micro_batches import (
    fixed_count_micro_batches,
    padded_length,
    padding_waste,
    token_budget_micro_batches,
)

# ---------------------------------------------------------------- grouping


def test_token_budget_grouping_by_hand():
    # sorted longest first: 9 (pos 2), 9 (5), 5 (0), 4 (4), 3 (1), 2 (3); budget 18:
    #   [2, 5]: 2 rows x 9 = 18; a third row of width 9 would be 27
    #   [0, 4, 1]: 3 x 5 = 15; a fourth row would be 20
    #   [3]
    groups = token_budget_micro_batches([5, 3, 9, 2, 4, 9], 18)
    assert groups == [[2, 5], [0, 4, 1], [3]]
    # padded tokens: 0 + (5-4 + 5-3) + 0 = 3 over 32 real ones
    assert padding_waste([5, 3, 9, 2, 4, 9], groups) == pytest.approx(3 / 32)
    # one long-enough budget: one micro-batch of 6 rows x 9
    assert token_budget_micro_batches([5, 3, 9, 2, 4, 9], 54) == [[2, 5, 0, 4, 1, 3]]


def test_token_budget_counts_padding_to_the_multiple():
    assert padded_length(5, 4) == 8 and padded_length(8, 4) == 8 and padded_length(0, 4) == 0
    assert token_budget_micro_batches([5, 5], 15, pad_to_multiple_of=4) == [[0], [1]]
    assert token_budget_micro_batches([5, 5], 16, pad_to_multiple_of=4) == [[0, 1]]


def test_token_budget_invariant_on_long_tailed_lengths():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(6.0, 1.0, size=500).astype(int) + 1, 4096).tolist()
    budget, multiple = 8192, 2
    groups = token_budget_micro_batches(lengths, budget, pad_to_multiple_of=multiple)
    assert sorted(i for g in groups for i in g) == list(range(500))
    for g in groups:
        width = padded_length(max(lengths[i] for i in g), multiple)
        assert len(g) * width <= budget
    # greedy: every closed micro-batch is full (one more row of its width would not fit)
    for a in groups[:-1]:
        width = padded_length(lengths[a[0]], multiple)
        assert (len(a) + 1) * width > budget
    fixed = fixed_count_micro_batches(500, 32)
    assert padding_waste(lengths, groups, multiple) < 0.05
    assert padding_waste(lengths, fixed, multiple) > 1.0  # a long tail pads most of each slice


def test_oversized_sample_is_named_unless_context_parallel_splits_it():
    with pytest.raises(ValueError, match=r"sample 11 has 20 tokens.*max_tokens_per_micro_batch=16"):
        token_budget_micro_batches([3, 20], 16, names=[10, 11])
    # CP 2: 20 tokens padded to 20 (multiple 4 = 2 x CP), 10 per rank
    assert token_budget_micro_batches([20, 3], 12, pad_to_multiple_of=4, context_parallel_size=2)
    with pytest.raises(ValueError, match="not divisible by 2 x CP = 4"):
        token_budget_micro_batches([20], 12, pad_to_multiple_of=2, context_parallel_size=2)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        token_budget_micro_batches([2], 0)
    with pytest.raises(ValueError, match="every sample exactly once"):
        padding_waste([2, 3], [[0], [0]])


def test_fixed_count_slices():
    assert fixed_count_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_count_micro_batches(0, 2) == []


def test_config_field():
    from megatron_sat.config import load_config

    cfg = load_config(None, ["train.max_tokens_per_micro_batch=4096"])
    assert cfg.train.max_tokens_per_micro_batch == 4096
    assert load_config(None, []).train.max_tokens_per_micro_batch is None
    with pytest.raises(ValueError, match="train.max_tokens_per_micro_batch must be > 0"):
        load_config(None, ["train.max_tokens_per_micro_batch=0"])


# ---------------------------------------------------------------- packing rule


def test_dense_packing_rule_by_hand():
    from megatron_sat.training.packing import dense_packing_rows

    # W = 9: decreasing 9 (pos 1), 5 (0), 4 (2), 3 (3): rows [9], [5, 4], [3] -> 3 rows < 4
    assert dense_packing_rows([5, 9, 4, 3], have_te=False) == [[1], [0, 2], [3]]
    # near-equal lengths save no row: padded
    assert dense_packing_rows([9, 8, 9], have_te=False) is None
    # W rounded up to the multiple: 10 -> 12 holds 6 + 6
    assert dense_packing_rows([10, 6, 6], 4, have_te=False) == [[0], [1, 2]]
    assert dense_packing_rows([10, 6, 6], 1, have_te=False) is None
    assert dense_packing_rows([5, 9, 4, 3], have_te=True) is None  # THD is TE's packing
    assert dense_packing_rows([3], have_te=False) is None


def test_pack_rows_keeps_the_sample_order_and_places_routes_like_tokens():
    from megatron_sat.training.packing import pack_rows

    samples = _samples_with_routes(4)
    lengths = [s.num_tokens for s in samples]
    rows = [[2, 0], [1, 3]]
    packed = pack_rows(samples, torch.arange(4.0), rows, pad_token_id=0, routing_shape=(3, 2, 8))
    assert packed.sample_indices == [0, 1, 2, 3] and torch.equal(
        packed.advantages, torch.arange(4.0)
    )
    assert packed.input_ids.shape == (2, max(lengths[2] + lengths[0], lengths[1] + lengths[3]))
    padded = build_micro_batch(samples, torch.arange(4.0), pad_token_id=0, routing_shape=(3, 2, 8))
    assert torch.equal(packed.loss_mask, padded.loss_mask)
    # row 0 starts with sample 2, then sample 0: tokens and routes from the same index map
    n2 = lengths[2]
    assert torch.equal(packed.input_ids[0, :n2], padded.input_ids[2, :n2])
    assert torch.equal(packed.routes[0, : n2 - 1], padded.routes[2, : n2 - 1])
    assert torch.equal(
        packed.routes[0, n2 : n2 + lengths[0] - 1], padded.routes[0, : lengths[0] - 1]
    )
    # the model-layout log-probs of sample 0 come back to its own row of the sample layout
    x = torch.zeros(packed.input_ids.shape)
    x[0, n2 : n2 + lengths[0]] = 1.0
    back = packed.to_sample_layout(x)
    assert back[0, : lengths[0]].eq(1).all() and back.sum() == lengths[0]
    with pytest.raises(ValueError, match="every sample exactly once"):
        pack_rows(samples, torch.zeros(4), [[0, 1], [2]], pad_token_id=0)


# ---------------------------------------------------------------- context parallelism


def test_load_balanced_positions_by_hand():
    assert context_parallel_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert [context_parallel_positions(8, r, 4).tolist() for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]
    assert context_parallel_positions(6, 0, 1).tolist() == list(range(6))
    with pytest.raises(ValueError, match="not divisible by 2 x CP = 4"):
        context_parallel_positions(6, 0, 2)
    with pytest.raises(ValueError, match="cp_rank 2 outside"):
        context_parallel_positions(8, 2, 2)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_slicing_matches_megatron_core(monkeypatch, cp_size):
    # megatron-core's own split (get_batch_on_this_cp_rank without cu_seqlens) as the oracle;
    # it reads the CP rank and size from torch.distributed, given here per rank.
    from megatron.core import utils

    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    mask = torch.arange(2 * 16 * 16).view(2, 1, 16, 16)
    for rank in range(cp_size):
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp_size)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        want = utils._get_batch_on_this_cp_rank_per_sequence_balancing(
            {"tokens": x.clone(), "attention_mask": mask.clone()}, cp_group=None
        )
        assert torch.equal(slice_context_parallel(x, rank, cp_size), want["tokens"])
        got_mask = slice_context_parallel(mask, rank, cp_size, seq_dim=2)
        assert torch.equal(got_mask, want["attention_mask"])


def _samples_with_routes(num: int, layers: int = 3, top_k: int = 2, experts: int = 8):
    rng = np.random.default_rng(3)
    out = []
    for i in range(num):
        p, r = int(rng.integers(2, 5)), int(rng.integers(1, 9))
        tokens = rng.integers(3, 50, size=p + r).tolist()
        routes = np.stack(
            [
                np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)])
                for _ in range(p + r - 1)
            ]
        ).astype(np.uint8)
        out.append(
            Sample(
                index=i,
                group_index=0,
                prompt="",
                label="",
                prompt_ids=tokens[:p],
                response_ids=tokens[p:],
                rollout_log_probs=rng.normal(-1.0, 0.3, size=r).tolist(),
                response_versions=[1] * r,
                routed_experts=routes,
            )
        )
    return out


def assert_same_micro_batch(got, want) -> None:
    for name in SEQUENCE_FIELDS + ("advantages",):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.sample_indices == want.sample_indices


def test_cp2_slicing_of_tokens_routes_and_masks_reassembles_exactly():
    samples = _samples_with_routes(5)
    mb = build_micro_batch(
        samples,
        torch.linspace(-1, 1, 5),
        pad_token_id=0,
        routing_shape=(3, 2, 8),
        pad_to_multiple_of=4,
    )
    seq = mb.input_ids.shape[1]
    pieces = [slice_micro_batch_context_parallel(mb, r, 2) for r in range(2)]
    for r, piece in enumerate(pieces):
        positions = context_parallel_positions(seq, r, 2)
        assert piece.input_ids.shape == (5, seq // 2)
        assert piece.routes.shape == (5, seq // 2, 3, 2) and piece.routes.dtype == torch.uint8
        # every sequence field cut by the same positions: routes stay on their tokens
        assert torch.equal(piece.routes, mb.routes[:, positions])
        assert torch.equal(piece.loss_mask, mb.loss_mask[:, positions])
        assert torch.equal(piece.position_ids, mb.position_ids[:, positions])
        assert torch.equal(piece.advantages, mb.advantages)
    # the two ranks together hold every active token once
    assert sum(float(p.loss_mask.sum()) for p in pieces) == float(mb.loss_mask.sum())
    assert_same_micro_batch(reassemble_micro_batch_context_parallel(pieces), mb)


def test_a_misplaced_chunk_fails_the_reassembly_check():
    samples = _samples_with_routes(4)
    mb = build_micro_batch(
        samples, torch.ones(4), pad_token_id=0, routing_shape=(3, 2, 8), pad_to_multiple_of=4
    )
    pieces = [slice_micro_batch_context_parallel(mb, r, 2) for r in range(2)]
    half = mb.input_ids.shape[1] // 4  # one chunk
    # rank 0 holds (chunk 0, chunk 3); put them the other way round
    swapped = {
        name: torch.cat([getattr(pieces[0], name)[:, half:], getattr(pieces[0], name)[:, :half]], 1)
        for name in SEQUENCE_FIELDS
    }
    bad = [dataclasses.replace(pieces[0], **swapped), pieces[1]]
    with pytest.raises(AssertionError):
        assert_same_micro_batch(reassemble_micro_batch_context_parallel(bad), mb)
    # ranks exchanged
    with pytest.raises(AssertionError):
        assert_same_micro_batch(reassemble_micro_batch_context_parallel(pieces[::-1]), mb)
    # a naive contiguous split (rank r = positions [r S/2, (r+1) S/2)) is not megatron-core's
    seq = mb.input_ids.shape[1]
    assert not torch.equal(pieces[0].input_ids, mb.input_ids[:, : seq // 2])


def test_reassemble_refuses_mismatched_pieces():
    x = torch.arange(16).view(1, 16)
    pieces = [slice_context_parallel(x, r, 2) for r in range(2)]
    assert torch.equal(reassemble_context_parallel(pieces), x)
    with pytest.raises(ValueError, match="CP rank 1's piece has shape"):
        reassemble_context_parallel([pieces[0], pieces[1][:, :2]])
    with pytest.raises(ValueError, match="no context-parallel pieces"):
        reassemble_context_parallel([])
    samples = _samples_with_routes(2)
    a = build_micro_batch(samples, torch.ones(2), pad_token_id=0, pad_to_multiple_of=4)
    b = dataclasses.replace(a, sample_indices=[7, 8])
    with pytest.raises(ValueError, match="CP rank 1's piece holds other samples"):
        reassemble_micro_batch_context_parallel(
            [
                slice_micro_batch_context_parallel(a, 0, 2),
                slice_micro_batch_context_parallel(b, 1, 2),
            ]
        )


def test_cpu_run_with_context_parallel_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path
    with pytest.raises(ValueError, match="context_parallel_size=2.*transformer-engine"):
        init_distributed(ParallelConfig(context_parallel_size=2))
    with pytest.raises(ValueError, match="parallel.context_parallel_size must be >= 1"):
        ParallelConfig(context_parallel_size=0)


# ---------------------------------------------------------------- launch plan with CP

RECIPE = "examples/configs/qwen3_30b_a3b_sat_gspo_r3.yaml"


def test_launch_plan_places_context_parallel_ranks_as_megatron_core():
    """The plan's CP groups are megatron-core's (for when the steps run CP), while the plan
    refuses CP > 1 today, as the trainer does."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_sat.config import load_config
    from megatron_sat.launch.plan import _groups_and_ranks, resolve_plan

    cfg = load_config(
        RECIPE,
        [
            "parallel.tensor_model_parallel_size=2",
            "parallel.context_parallel_size=2",
            "train.recompute_granularity=full",
        ],
    )
    with pytest.raises(ValueError, match="context_parallel_size=2: the trainer's steps do not"):
        resolve_plan(cfg)
    groups, ranks = _groups_and_ranks(cfg.launch, 4, tp=2, cp=2, pp=1, dp=1, etp=1, ep=1, edp=4)
    gen = RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    assert groups["context parallel"] == gen.get_ranks("cp") == [[0, 2], [1, 3]]
    assert groups["data-context parallel (dp-cp)"] == gen.get_ranks("dp-cp")
    assert groups["tensor parallel"] == gen.get_ranks("tp")
    assert [(r.tp, r.cp) for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_launch_plan_refuses_cp_on_cpu_and_a_budget_below_the_longest_sample():
    from megatron_sat.config import load_config
    from megatron_sat.launch.plan import resolve_plan

    tp2_cp2 = ["parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=2"]
    with pytest.raises(ValueError, match="context_parallel_size=2 with launch.device=cpu.*transf"):
        resolve_plan(
            load_config(
                RECIPE,
                tp2_cp2
                + [
                    "launch.device=cpu",
                    "launch.rollout_engine=embedded",
                    "launch.rollout_server_tp=1",
                ],
            )
        )
    with pytest.raises(ValueError, match="context_parallel_size=4 x TP 2 x PP 1 does not divide"):
        resolve_plan(
            load_config(
                RECIPE,
                ["parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=4"],
            )
        )
    cfg = load_config(RECIPE)
    new = cfg.rollout.max_new_tokens
    with pytest.raises(ValueError, match=f"max_tokens_per_micro_batch={new}: a sample of"):
        resolve_plan(load_config(RECIPE, [f"train.max_tokens_per_micro_batch={new}"]))
    # CP 2 halves each rank's share of a row: the same budget now fits (only the refusal of
    # CP itself remains)
    from megatron_sat.config.layout import context_parallel_errors

    cp2 = load_config(RECIPE, tp2_cp2 + [f"train.max_tokens_per_micro_batch={new}"])
    assert context_parallel_errors(cp2, 4, 2, 2, 1) == [
        "parallel.context_parallel_size=2: the trainer's steps do not run context parallelism "
        "yet (PolicyTrainer refuses it); use context_parallel_size=1"
    ]
