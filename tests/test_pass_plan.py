"""Which no-grad passes an RL step runs (``plan_passes``), by a hand-written table.

Each row's expectation was read off ``PolicyTrainer.rl_step`` before it became phases (the
block with ``needs_old``, ``global_q``, ``live``, ``trained_routing`` and ``skipped``):

- old log-probs are needed for "recomputed_old", TIS and IcePop; SAT's global quantile for a
  SAT objective when the global batch is split (several micro-batches or DP ranks);
- the live pass runs on diagnostic steps, and without R3 whenever old log-probs or the
  global quantile are needed (the live routing is the trained one then);
- the replayed pass runs with R3 when old log-probs or the global quantile are needed;
- the ``*_live`` metrics are reported on diagnostic steps only, also when the live pass ran
  for the trained routing (the subtle case: sat, split, no R3, no diagnostic);
- the reference pass runs with ``kl_coef > 0``, replaying the routes under R3.

The table also drives ``run_no_grad_passes`` with a stub trainer: the passes in the
``passes`` column run, in that order, and the step gets the right outputs from them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.training.pass_plan import PassPlan, plan_passes
from megatron_sat.training.passes import run_no_grad_passes

OBJECTIVES = {
    "plain": dict(name="gspo"),  # rollout denominator: neither old log-probs nor q
    "sat": dict(name="sat-gspo"),
    "sat-grpo": dict(name="sat-grpo"),
    "recomputed": dict(name="grpo", ratio_denominator="recomputed_old"),
    "sat+recomputed": dict(name="sat-gspo", ratio_denominator="recomputed_old"),
    "tis": dict(name="grpo", tis_cap=2.0),
    "icepop": dict(name="grpo", icepop_range=(0.5, 2.0)),
}

# kind, split batch, R3, diagnostic, kl_coef > 0 | passes run, in order ("ref(r3)": the
# reference pass replays), *_live reported, trained routing's pass, old log-probs, global q
TABLE = """
plain           n  n  n  n  | -                      n  -         n  n
plain           n  n  n  y  | ref                    n  -         n  n
plain           n  n  y  n  | live                   y  -         n  n
plain           n  n  y  y  | live,ref               y  -         n  n
plain           n  y  n  n  | -                      n  -         n  n
plain           n  y  n  y  | ref(r3)                n  -         n  n
plain           n  y  y  n  | live                   y  -         n  n
plain           n  y  y  y  | live,ref(r3)           y  -         n  n
plain           y  n  n  n  | -                      n  -         n  n
plain           y  n  n  y  | ref                    n  -         n  n
plain           y  n  y  n  | live                   y  -         n  n
plain           y  n  y  y  | live,ref               y  -         n  n
plain           y  y  n  n  | -                      n  -         n  n
plain           y  y  n  y  | ref(r3)                n  -         n  n
plain           y  y  y  n  | live                   y  -         n  n
plain           y  y  y  y  | live,ref(r3)           y  -         n  n
sat             n  n  n  n  | -                      n  -         n  n
sat             n  n  n  y  | ref                    n  -         n  n
sat             n  n  y  n  | live                   y  -         n  n
sat             n  n  y  y  | live,ref               y  -         n  n
sat             n  y  n  n  | -                      n  -         n  n
sat             n  y  n  y  | ref(r3)                n  -         n  n
sat             n  y  y  n  | live                   y  -         n  n
sat             n  y  y  y  | live,ref(r3)           y  -         n  n
sat             y  n  n  n  | live                   n  live      n  y
sat             y  n  n  y  | live,ref               n  live      n  y
sat             y  n  y  n  | live                   y  live      n  y
sat             y  n  y  y  | live,ref               y  live      n  y
sat             y  y  n  n  | replayed               n  replayed  n  y
sat             y  y  n  y  | replayed,ref(r3)       n  replayed  n  y
sat             y  y  y  n  | live,replayed          y  replayed  n  y
sat             y  y  y  y  | live,replayed,ref(r3)  y  replayed  n  y
sat-grpo        n  y  n  n  | -                      n  -         n  n
sat-grpo        y  n  n  n  | live                   n  live      n  y
sat-grpo        y  y  n  n  | replayed               n  replayed  n  y
recomputed      n  n  n  n  | live                   n  live      y  n
recomputed      n  n  n  y  | live,ref               n  live      y  n
recomputed      n  n  y  n  | live                   y  live      y  n
recomputed      n  n  y  y  | live,ref               y  live      y  n
recomputed      n  y  n  n  | replayed               n  replayed  y  n
recomputed      n  y  n  y  | replayed,ref(r3)       n  replayed  y  n
recomputed      n  y  y  n  | live,replayed          y  replayed  y  n
recomputed      n  y  y  y  | live,replayed,ref(r3)  y  replayed  y  n
recomputed      y  n  n  n  | live                   n  live      y  n
recomputed      y  n  n  y  | live,ref               n  live      y  n
recomputed      y  n  y  n  | live                   y  live      y  n
recomputed      y  n  y  y  | live,ref               y  live      y  n
recomputed      y  y  n  n  | replayed               n  replayed  y  n
recomputed      y  y  n  y  | replayed,ref(r3)       n  replayed  y  n
recomputed      y  y  y  n  | live,replayed          y  replayed  y  n
recomputed      y  y  y  y  | live,replayed,ref(r3)  y  replayed  y  n
sat+recomputed  n  n  n  n  | live                   n  live      y  n
sat+recomputed  n  n  n  y  | live,ref               n  live      y  n
sat+recomputed  n  n  y  n  | live                   y  live      y  n
sat+recomputed  n  n  y  y  | live,ref               y  live      y  n
sat+recomputed  n  y  n  n  | replayed               n  replayed  y  n
sat+recomputed  n  y  n  y  | replayed,ref(r3)       n  replayed  y  n
sat+recomputed  n  y  y  n  | live,replayed          y  replayed  y  n
sat+recomputed  n  y  y  y  | live,replayed,ref(r3)  y  replayed  y  n
sat+recomputed  y  n  n  n  | live                   n  live      y  y
sat+recomputed  y  n  n  y  | live,ref               n  live      y  y
sat+recomputed  y  n  y  n  | live                   y  live      y  y
sat+recomputed  y  n  y  y  | live,ref               y  live      y  y
sat+recomputed  y  y  n  n  | replayed               n  replayed  y  y
sat+recomputed  y  y  n  y  | replayed,ref(r3)       n  replayed  y  y
sat+recomputed  y  y  y  n  | live,replayed          y  replayed  y  y
sat+recomputed  y  y  y  y  | live,replayed,ref(r3)  y  replayed  y  y
tis             y  n  n  n  | live                   n  live      y  n
tis             y  n  y  n  | live                   y  live      y  n
tis             y  y  n  n  | replayed               n  replayed  y  n
tis             y  y  y  n  | live,replayed          y  replayed  y  n
tis             n  y  n  y  | replayed,ref(r3)       n  replayed  y  n
icepop          y  n  n  n  | live                   n  live      y  n
icepop          y  n  y  n  | live                   y  live      y  n
icepop          y  y  n  n  | replayed               n  replayed  y  n
icepop          y  y  y  n  | live,replayed          y  replayed  y  n
icepop          n  n  n  y  | live,ref               n  live      y  n
"""


def parse(table: str) -> list[tuple]:
    rows = []
    for line in table.strip().splitlines():
        left, right = line.split("|")
        kind, split, r3, diag, kl = left.split()
        passes, report, trained, old, q = right.split()
        yes = {"y": True, "n": False}
        rows.append(
            (
                kind,
                yes[split],
                yes[r3],
                yes[diag],
                yes[kl],
                [] if passes == "-" else passes.split(","),
                yes[report],
                None if trained == "-" else trained,
                yes[old],
                yes[q],
            )
        )
    return rows


ROWS = parse(TABLE)


def test_the_table_covers_every_combination():
    keys = {row[:5] for row in ROWS}
    assert len(keys) == len(ROWS)  # no row twice
    for kind in ("plain", "sat", "recomputed", "sat+recomputed"):
        for bits in range(16):
            split, r3, diag, kl = (bool(bits >> k & 1) for k in (3, 2, 1, 0))
            assert (kind, split, r3, diag, kl) in keys


def objective(kind: str, kl: bool) -> ObjectiveConfig:
    return ObjectiveConfig(**OBJECTIVES[kind], kl_coef=0.1 if kl else 0.0)


@pytest.mark.parametrize(
    "kind,split,r3,diag,kl,passes,report,trained,old,q",
    ROWS,
    ids=[" ".join(map(str, row[:5])) for row in ROWS],
)
def test_plan(kind, split, r3, diag, kl, passes, report, trained, old, q):
    plan = plan_passes(objective(kind, kl), use_r3=r3, diagnostic=diag, split_batch=split)
    assert plan == PassPlan(
        live="live" in passes,
        replayed="replayed" in passes,
        reference=kl,
        reference_replays=r3,
        live_metrics=report,
        old_log_probs=old,
        global_quantile=q,
        trained_routing=trained,
    )


@pytest.mark.parametrize(
    "kind,split,r3,diag,kl,passes,report,trained,old,q",
    ROWS,
    ids=[" ".join(map(str, row[:5])) for row in ROWS],
)
def test_the_planned_passes_run_in_order(
    kind, split, r3, diag, kl, passes, report, trained, old, q
):
    plan = plan_passes(objective(kind, kl), use_r3=r3, diagnostic=diag, split_batch=split)
    calls = []

    def no_grad_log_probs(mbs, replay, reference=False):
        name = ("ref" if reference else "replayed" if replay else "live") + (
            "(r3)" if reference and replay else ""
        )
        calls.append(name)
        assert len(mbs) == 3  # fillers included
        return [(f"{name} lp{i}", f"{name} match{i}") for i in range(len(mbs))]

    stub = SimpleNamespace(_no_grad_log_probs=no_grad_log_probs)
    out = run_no_grad_passes(stub, ["mb0", "mb1", "filler"], 2, plan)

    assert calls == passes
    ref_name = "ref(r3)" if r3 else "ref"
    assert out.ref_log_probs == ([f"{ref_name} lp{i}" for i in range(2)] if kl else [None] * 2)
    if report:
        assert out.live == [(f"live lp{i}", f"live match{i}") for i in range(2)]
    else:  # absent metrics, also when the live pass ran for the trained routing
        assert out.live == [(None, None)] * 2
    if trained is not None:
        assert [lp for lp, _ in out.trained_routing] == [f"{trained} lp{i}" for i in range(2)]
    expected_old = [f"{trained} lp{i}" for i in range(2)] if old else [None] * 2
    assert out.old_log_probs == expected_old
