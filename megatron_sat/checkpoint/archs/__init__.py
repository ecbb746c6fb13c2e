"""Per-architecture HF <-> megatron-core name maps, chosen by the HF ``architectures`` name.

Each module defines ``MAP``: an :class:`~megatron_sat.checkpoint.archs.spec.ArchMap` of rules
from megatron-core's canonical (local-spec) parameter names to Hugging Face on-disk names.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from megatron_sat.checkpoint.archs.spec import ArchMap, Rule
from megatron_sat.models.registry import ARCHITECTURES, architecture_of

__all__ = ["ArchMap", "Rule", "arch_map"]


def arch_map(hf_config: Mapping[str, Any]) -> ArchMap:
    """The name map of ``hf_config``'s architecture.

    Raises:
        ValueError: for an architecture without a map (names the supported ones).
    """
    module = importlib.import_module(f"{__name__}.{ARCHITECTURES[architecture_of(hf_config)]}")
    return module.MAP
