"""The rollout engine contract (rollout/engine.py), the weight push's channels
(weight_sync/channel.py) and the engine registry (rollout/engines.py) hold together."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megatron_sat.config.launch import ROLLOUT_ENGINES
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.engine import RolloutClient
from megatron_sat.rollout.engines import ENGINES, server_launch
from megatron_sat.rollout.vllm.client import VLLMClient
from megatron_sat.rollout.vllm.updater import VLLMUpdateChannel, VLLMWeightUpdater
from megatron_sat.weight_sync.broadcast import WeightUpdater
from megatron_sat.weight_sync.channel import SGLangUpdateChannel

ROOT = Path(__file__).resolve().parents[1]


def _protocol_methods(protocol: type) -> set[str]:
    return {
        name
        for klass in protocol.__mro__
        if klass is not object and getattr(klass, "_is_protocol", False)
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    }


@pytest.mark.parametrize(
    ("client", "protocols"),
    [
        (SGLangClient, (RolloutClient, SGLangUpdateChannel)),
        (VLLMClient, (RolloutClient, VLLMUpdateChannel)),
    ],
)
def test_clients_implement_the_contract_and_their_channel(client, protocols):
    for protocol in protocols:
        for name in _protocol_methods(protocol):
            assert callable(getattr(client, name, None)), f"{client.__name__}.{name}"
            # Every keyword the protocol names is accepted.
            wanted = inspect.signature(getattr(protocol, name)).parameters
            given = inspect.signature(getattr(client, name)).parameters
            assert set(wanted) <= set(given), f"{client.__name__}.{name}: {wanted} vs {given}"


def test_each_engine_has_its_client_fleet_and_updater():
    assert ENGINES["sglang"].fleet.updater_cls is WeightUpdater
    assert ENGINES["vllm"].fleet.updater_cls is VLLMWeightUpdater
    assert isinstance(ENGINES["sglang"].client("http://127.0.0.1:1", None), SGLangClient)
    assert isinstance(ENGINES["vllm"].client("http://127.0.0.1:1", None), VLLMClient)


def test_every_launch_engine_has_one_server_launch():
    names = [n for spec in ENGINES.values() for n in spec.servers]
    assert sorted(names) == sorted(ROLLOUT_ENGINES)
    for name in ROLLOUT_ENGINES:
        assert server_launch(name) is not None
    with pytest.raises(KeyError, match="none of"):
        server_launch("foo")


def test_weight_sync_imports_no_rollout_module():
    for path in (ROOT / "megatron_sat" / "weight_sync").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("megatron_sat.rollout"), (path, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("megatron_sat.rollout"), (path, alias.name)
