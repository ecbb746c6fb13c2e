"""R3 replay under TP+SP, EP (alltoall, allgather), TP x EP and PP + full recompute, on packed
sequences of unequal lengths: ONE torchrun launch (2 gloo ranks) for every case.

    torchrun --nproc_per_node=2 tests/dist/r3_parallel.py

For each case every rank builds the parallel model, loads its shard of the reference weights,
replays random routes (distinct experts per token, so live routing would differ almost
everywhere) through megatron-core's schedule (1F1B under PP) with a RoutingReplay session, and
prints one JSON line per rank: the fraction of real tokens whose used experts (forward, and
recompute where there is one) equal the targets, the relative error of the loss and of every
gradient against the TP = EP = PP = 1 reference run on the same packed micro-batches, and the
audit metric. The PP case also runs record mode (live routing recorded, recompute replaying the
recording) against a live-routing reference. Rank 0 prints ``R3_DONE`` at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch


def _emit(result: dict) -> None:
    """One JSON line per case in this rank's own file: two ranks printing to one pipe can
    interleave their lines."""
    out = Path(os.environ["R3_RESULT_DIR"]) / f"rank{result['rank']}.jsonl"
    with out.open("a") as f:
        f.write(json.dumps(result) + "\n")


from r3_common import (
    HF_CONFIG,
    build,
    canonical_names,
    full_params,
    load_full,
    make_samples,
    max_rel_err,
    nll_loss,
    reduced_grads,
    set_parallel,
    shard_of,
)

# (prompt, response) lengths: 13 samples of unequal length, packed first-fit into 4 rows of 40.
LENGTHS = [(5, 9), (3, 7), (6, 4), (4, 8), (7, 6), (2, 9), (5, 5), (3, 12), (6, 3), (4, 4),
           (8, 5), (2, 3), (5, 6)]  # fmt: skip
HF_CONFIGS = {"all_moe": HF_CONFIG, "first_dense": dict(HF_CONFIG, mlp_only_layers=[0])}
CASES = [
    dict(name="tp2_sp", tp=2, dispatcher="alltoall"),
    dict(name="ep2_alltoall", ep=2, dispatcher="alltoall"),
    dict(name="ep2_allgather", ep=2, dispatcher="allgather"),
    dict(name="tp2_ep2", tp=2, ep=2, etp=1, dispatcher="alltoall"),
    dict(name="tp2_sp_allgather_recompute", tp=2, dispatcher="allgather", recompute="full"),
    dict(name="pp2_1f1b_recompute", pp=2, recompute="full", hf="first_dense", naive_control=True),
]


def micro_batches(hf_config):
    from megatron_sat.training.packing import pack_micro_batches

    samples = make_samples(LENGTHS, hf_config)
    advantages = torch.linspace(-1.0, 1.0, len(samples))
    shape = (hf_config["num_hidden_layers"], hf_config["num_experts_per_tok"], 8)
    mbs = pack_micro_batches(
        samples,
        advantages,
        pad_token_id=0,
        max_tokens_per_row=40,
        routing_shape=shape,
        pad_to_multiple_of=2,
    )
    assert len(mbs) == 4, [len(mb.samples.input_ids) for mb in mbs]
    assert all(mb.samples.input_ids.shape[0] > 1 for mb in mbs)  # really packed
    return mbs


def run(model, mbs, num_tokens, mode="replay"):
    """One forward/backward over ``mbs`` with a fresh RoutingReplay on ``model``."""
    from megatron_sat.routing.replay import RoutingReplay
    from megatron_sat.training.logprobs import forward_backward

    controller = RoutingReplay(model)
    model.zero_grad(set_to_none=True)
    if mode == "replay":
        routes = {i: controller.routes_for(mb.routes, mb.routes_valid) for i, mb in enumerate(mbs)}
        session = controller.replay(routes, training=True, capture=True)
    else:
        routes = {}
        session = controller.record(training=True, capture=True)
    with session as report:
        out = forward_backward([model], mbs, nll_loss(num_tokens), replay=controller)
    loss = sum(float(o["loss"]) for o in out) if out else None
    return controller, routes, report, loss


class NaiveReplay:
    """Negative control: megatron-core's replay driven the obvious way, REPLAY_FORWARD set in
    each forward step and never switched for the recompute (ARCHITECTURE.md measured this
    silently wrong under 1F1B + recompute). Duck-types RoutingReplay.micro_batch."""

    def __init__(self, model, routes):
        from megatron_sat.routing.replay import find_routers

        self.routers, self.routes = find_routers(model), routes

    @contextlib.contextmanager
    def micro_batch(self, index):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, router in self.routers.items():
            router.router_replay.set_target_indices(self.routes[index].targets[layer])
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield

    def clear(self):
        for router in self.routers.values():
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def match_fraction(report, routes):
    """(forward, recompute) fraction of real tokens whose routing map equals the target."""
    fractions = []
    for maps in (report.used, report.recomputed):
        hit, total = 0, 0
        for (mb, layer), used in maps.items():
            target = routes[mb].targets[layer]
            want = torch.zeros_like(used).scatter_(1, target, True)
            same = (used == want).all(dim=1)
            real = routes[mb].real
            hit += int(same[real].sum())
            total += int(real.sum())
        fractions.append(hit / total if total else None)
    return fractions


def main() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    rank = int(os.environ["RANK"])
    refs = {}
    for key, hf in HF_CONFIGS.items():
        set_parallel()
        mbs = micro_batches(hf)
        num_tokens = float(sum(mb.samples.loss_mask.sum() for mb in mbs))
        ref = build(hf)
        _, ref_routes, _, ref_loss = run(ref, mbs, num_tokens)
        ref_grads = {canonical_names(ref)[n]: p.grad.clone() for n, p in ref.named_parameters()}
        entry = dict(full=full_params(ref), loss=ref_loss, grads=ref_grads, mbs=mbs, n=num_tokens)
        _, _, rec_report, live_loss = run(ref, mbs, num_tokens, mode="record")
        entry["live_loss"] = live_loss
        entry["live_grads"] = {
            canonical_names(ref)[n]: p.grad.clone() for n, p in ref.named_parameters()
        }
        entry["recorded"] = rec_report.recorded
        refs[key] = entry
        del ref

    for case in CASES:
        start = time.perf_counter()
        ref = refs[case.get("hf", "all_moe")]
        hf = HF_CONFIGS[case.get("hf", "all_moe")]
        tp, pp, ep = case.get("tp", 1), case.get("pp", 1), case.get("ep", 1)
        set_parallel(tp=tp, pp=pp, ep=ep, etp=case.get("etp"))
        model = build(
            hf,
            tp=tp,
            pp=pp,
            ep=ep,
            etp=case.get("etp"),
            dispatcher=case["dispatcher"] if "dispatcher" in case else "alltoall",
            recompute=case.get("recompute"),
        )
        load_full(model, ref["full"])
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        local = ref["mbs"][dp_rank::dp]
        controller, routes, report, loss = run(model, local, ref["n"])
        fwd_match, recompute_match = match_fraction(report, routes)
        result = dict(
            case=case["name"],
            rank=rank,
            layers=controller.layers,
            micro_batches=len(local),
            forward_match=fwd_match,
            recompute_match=recompute_match,
            recomputes=sum(report.recomputes.values()),
        )
        result.update(report.metrics(hf["num_hidden_layers"]))
        if loss is not None:
            total = torch.tensor(loss, dtype=torch.float64)
            torch.distributed.all_reduce(total, group=ps.get_data_parallel_group())
            result["loss_rel_err"] = abs(float(total) - ref["loss"]) / abs(ref["loss"])
        names = canonical_names(model)
        params = dict(model.named_parameters())
        got = reduced_grads(model)
        want = {names[n]: shard_of(ref["grads"][names[n]], p) for n, p in params.items()}
        result["grad_rel_err"], result["grad_worst"] = max_rel_err(got, want)
        result["num_grads"] = len(got)
        if case.get("naive_control"):
            from megatron_sat.training.logprobs import forward_backward

            naive = NaiveReplay(model, routes)
            model.zero_grad(set_to_none=True)
            forward_backward([model], local, nll_loss(ref["n"]), replay=naive)
            naive.clear()
            result["naive_grad_rel_err"], _ = max_rel_err(reduced_grads(model), want)
        if pp > 1:  # record mode under 1F1B + recompute against live routing at PP = 1
            _, _, rec, rec_loss = run(model, local, ref["n"], mode="record")
            got = reduced_grads(model)
            want = {names[n]: shard_of(ref["live_grads"][names[n]], p) for n, p in params.items()}
            result["record_grad_rel_err"], _ = max_rel_err(got, want)
            same = [
                torch.equal(v.sort(1).values, ref["recorded"][k].sort(1).values)
                for k, v in rec.recorded.items()
            ]
            result["record_equal_reference"] = all(same) and len(same) > 0
            result["record_recomputes"] = sum(rec.recomputes.values())
            result["record_recompute_equal_forward"] = all(
                torch.equal(rec.recomputed[k], rec.used[k]) for k in rec.used
            )
            if rec_loss is not None:
                result["record_loss_rel_err"] = abs(rec_loss - ref["live_loss"]) / abs(
                    ref["live_loss"]
                )
        result["seconds"] = round(time.perf_counter() - start, 2)
        _emit(result)
        del model
    result = dict(
        case="global_instances", rank=rank, count=len(RouterReplay.global_router_replay_instances)
    )
    _emit(result)
    torch.distributed.barrier()
    if rank == 0:
        print("R3_DONE", flush=True)


if __name__ == "__main__":
    main()
