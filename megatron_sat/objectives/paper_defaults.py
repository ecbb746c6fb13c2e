"""Each objective's settings as its own paper defines them, used where a config leaves them unset.

``objective.loss_agg_mode`` and ``objective.eps_low`` default to None, which resolves here by
``objective.name``; a config that sets a value departing from the objective's paper gets a
warning saying so (the run is valid, the name just no longer means the paper's method).

- gspo, gspo-token, sat-gspo: ``loss_agg_mode="seq-mean-token-mean"``, ``eps_low=0.2``. GSPO
  (arXiv 2507.18071) Eq. 5 averages a sequence-level term over responses, so long and short
  responses weigh the same (verl's GSPO recipe sets ``seq-mean-token-mean``); SAT-GSPO is GSPO
  with SAT's radii (SAT paper Eq. 19).
- cispo: ``loss_agg_mode="token-mean"``, ``eps_low=1.0``. MiniMax-M1 (arXiv 2506.13585)
  Eq. 4-5 normalises by the group's total token count and bounds the IS weight from above only
  (no lower bound: eps_low = 1 gives the bound 0).
- the others: ``loss_agg_mode="token-mean"``, ``eps_low=0.2``: the SAT paper's PPO/GRPO
  surrogate (Eq. 11) at its radii (0.2, 0.2), with DAPO's token-level mean (verl's default).

The clip radii of the GSPO paper (3e-4, 4e-4) are not applied: the SAT paper ran every method
at (0.2, 0.2), which Table 1 reproduces; set ``eps_low``/``eps_high`` for GSPO's own.
"""

from __future__ import annotations

from typing import Any

_SEQUENCE_MEAN = "seq-mean-token-mean"
PAPER_DEFAULTS: dict[str, dict[str, Any]] = {
    "gspo": {"loss_agg_mode": _SEQUENCE_MEAN, "eps_low": 0.2},
    "gspo-token": {"loss_agg_mode": _SEQUENCE_MEAN, "eps_low": 0.2},
    "sat-gspo": {"loss_agg_mode": _SEQUENCE_MEAN, "eps_low": 0.2},
    "cispo": {"loss_agg_mode": "token-mean", "eps_low": 1.0},
}
GENERIC_DEFAULTS: dict[str, Any] = {"loss_agg_mode": "token-mean", "eps_low": 0.2}
_PAPERS = {
    "gspo": "the GSPO paper",
    "gspo-token": "the GSPO paper",
    "sat-gspo": "GSPO (and the SAT paper's SAT-GSPO)",
    "cispo": "MiniMax-M1's CISPO",
}


def paper_default(name: str, field: str) -> Any:
    """The value of ``field`` (``loss_agg_mode`` or ``eps_low``) for objective ``name``."""
    return PAPER_DEFAULTS.get(name, GENERIC_DEFAULTS)[field]


def departure(name: str, field: str, value: Any) -> str | None:
    """Why ``objective.<field>=value`` departs from objective ``name``'s paper, or None when it
    does not (or the objective has no paper-specific setting for ``field``)."""
    if name not in PAPER_DEFAULTS or value == paper_default(name, field):
        return None
    want = paper_default(name, field)
    why = {
        "loss_agg_mode": "token-mean weights each response by its length, the paper's "
        "per-response mean weighs responses equally"
        if value == "token-mean"
        else "another weighting of responses",
        "eps_low": "a lower bound on the importance weight that the paper does not have",
    }[field]
    return (
        f"objective.{field}={value!r} with objective.name={name!r} departs from "
        f"{_PAPERS[name]} ({field}={want!r}): {why}"
    )


_UNSET = "_fields_left_unset"


def resolve_unset(config: object, name: str, value: Any) -> None:
    """Set ``config.name`` (None in the config) to ``value`` and remember that it was unset, so
    that a saved config writes it as null again (`unset_fields`): reloading the saved file
    with another ``objective.name`` then resolves it for that objective, not the first one."""
    setattr(config, name, value)
    config.__dict__.setdefault(_UNSET, set()).add(name)


def unset_fields(config: object) -> frozenset[str]:
    """The fields of ``config`` that `resolve_unset` filled in."""
    return frozenset(config.__dict__.get(_UNSET, ()))
