"""What a running SGLang server must have been started with for this trainer, read back from
its ``GET /server_info`` (sglang 0.5.23 ``srt/entrypoints/http_server.py`` ``server_info``:
``ServerArgs.resolved_dict()``, every field's resolved value, plus live state;
``/get_server_info`` is its deprecated alias). Servers the launcher starts get the right flags
(``rollout.sglang.args``); servers given by URL were started by someone else, so their flags
are checked before the run uses them. Pure: the caller fetches the dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _size(info: Mapping[str, Any], key: str) -> int:
    """A parallel size of ``info``; absent or null is 1 (SGLang's default)."""
    value = info.get(key)
    return 1 if value is None else int(value)


def server_flag_errors(
    info: Mapping[str, Any],
    *,
    deterministic: bool,
    routed_experts: bool,
    tp_size: int | None = None,
) -> list[str]:
    """Why an SGLang server with ``/server_info`` ``info`` cannot serve this run (empty: it can).

    Args:
        info: the server's ``/server_info`` reply.
        deterministic: the run needs per-request ``sampling_seed`` honoured (the logical clock,
            ``rollout.clock_tokens > 0``, and every run that must repeat).
        routed_experts: the run asks for routed experts (``rollout.return_routed_experts``).
        tp_size: the TP size the weight-update group is sized for (``launch.rollout_server_tp``;
            the group has 1 + sum of the servers' TP ranks, and a server with another TP size
            makes its rendezvous hang); None: not checked.

    Returns:
        one line per problem, naming the server flag that fixes it.
    """
    errors = []
    if deterministic and not info.get("enable_deterministic_inference", False):
        errors.append(
            "started without --enable-deterministic-inference: SGLang 0.5.23 uses a request's "
            "sampling_seed only with it (srt/sampling/sampling_batch_info.py), so the logical "
            "clock's runs (rollout.clock_tokens > 0) would not repeat"
        )
    if routed_experts and not info.get("enable_return_routed_experts", False):
        errors.append(
            "started without --enable-return-routed-experts, which rollout.return_routed_experts "
            "(and R3) needs"
        )
    if tp_size is not None and _size(info, "tp_size") != tp_size:
        errors.append(
            f"--tp-size {_size(info, 'tp_size')}, but launch.rollout_server_tp={tp_size} sizes "
            "the weight-update group (one rank per server TP rank): its rendezvous would hang; "
            "set launch.rollout_server_tp to the servers' --tp-size"
        )
    if _size(info, "dp_size") > 1:
        errors.append(
            f"--dp-size {info['dp_size']}: SGLang refuses weight updates from distributed with "
            "data-parallel replicas (managers/tokenizer_control_mixin.py); start one server per "
            "replica"
        )
    if _size(info, "pp_size") > 1:
        errors.append(
            f"--pp-size {info['pp_size']}: SGLang's pipeline stages join the weight-update group "
            "with colliding ranks, rank_offset + tp_rank "
            "(model_executor/model_runner_components/weight_updater.py); use --tp-size"
        )
    return errors
