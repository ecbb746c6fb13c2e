"""SGLang servers given by URL are checked for the flags the run needs, read back from their
``GET /server_info`` (sglang 0.5.23 ``http_server.server_info``: ``ServerArgs.resolved_dict()``,
one key per ``ServerArgs`` field; the field names are read from SGLang's own declarations,
``tests/sglang_reference.py`` ``cli_flags``)."""

from __future__ import annotations

import httpx
import pytest
import sglang_reference as ref

from megatron_sat.config import load_config
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.embedded.server import ServerConfig, ServerState, create_app
from megatron_sat.rollout.sglang.server_info import server_flag_errors
from megatron_sat.training.engines import check_sglang_servers

GOOD = {
    "enable_deterministic_inference": True,
    "enable_return_routed_experts": True,
    "dp_size": 1,
    "pp_size": 1,
    "tp_size": 4,
}


def test_the_keys_read_are_sglang_server_args_fields():
    fields = set(ref.cli_flags())
    assert set(GOOD) <= fields
    # /server_info is what SGLang 0.5.23 serves them on (/get_server_info its old alias).
    assert ref.route("/server_info", "GET") is not None
    assert ref.route("/get_server_info", "GET") is not None


def test_a_fit_server_passes():
    assert server_flag_errors(GOOD, deterministic=True, routed_experts=True) == []


@pytest.mark.parametrize(
    ("change", "deterministic", "routed", "message"),
    [
        ({"enable_deterministic_inference": False}, True, False, "--enable-deterministic"),
        ({"enable_return_routed_experts": False}, False, True, "--enable-return-routed-experts"),
        ({"dp_size": 2}, False, False, "--dp-size 2: SGLang refuses weight updates"),
        ({"pp_size": 2}, False, False, "--pp-size 2: SGLang's pipeline stages"),
    ],
)
def test_each_missing_flag_is_named(change, deterministic, routed, message):
    (error,) = server_flag_errors(
        {**GOOD, **change}, deterministic=deterministic, routed_experts=routed
    )
    assert message in error


def test_a_server_tp_other_than_the_groups_is_refused():
    """The weight-update group has one rank per server TP rank (``launch.rollout_server_tp``):
    a server started with another --tp-size would hang the rendezvous (a breaker's find)."""
    (error,) = server_flag_errors(GOOD, deterministic=False, routed_experts=False, tp_size=8)
    assert error.startswith("--tp-size 4, but launch.rollout_server_tp=8")
    assert server_flag_errors(GOOD, deterministic=False, routed_experts=False, tp_size=4) == []
    nulls = {**GOOD, "dp_size": None, "pp_size": None, "tp_size": None}  # null: SGLang's 1
    assert server_flag_errors(nulls, deterministic=False, routed_experts=False, tp_size=1) == []


def test_without_the_clock_a_server_without_deterministic_inference_is_fine():
    info = {**GOOD, "enable_deterministic_inference": False}
    assert server_flag_errors(info, deterministic=False, routed_experts=True) == []


def _client(url: str, info: dict) -> SGLangClient:
    client = SGLangClient(url)
    client._http = httpx.Client(
        base_url=url,
        transport=httpx.MockTransport(
            lambda request: (
                httpx.Response(200, json=info)
                if request.url.path == "/server_info"
                else httpx.Response(404)
            )
        ),
    )
    return client


def test_a_clock_run_refuses_a_url_server_without_deterministic_inference():
    cfg = load_config(
        None,
        [
            "rollout.server_urls=[http://a:1,http://b:2]",
            "rollout.mode=bounded",
            "rollout.clock_tokens=4",
            "launch.rollout_server_tp=4",
        ],
    )
    clients = [
        _client("http://a:1", GOOD),
        _client("http://b:2", {**GOOD, "enable_deterministic_inference": False}),
    ]
    with pytest.raises(ValueError, match=r"(?s)unfit for this run.*http://b:2: started without"):
        check_sglang_servers(clients, cfg)
    check_sglang_servers(clients[:1], cfg)
    with pytest.raises(ValueError, match=r"http://a:1: --tp-size 4, but launch.rollout_server_tp"):
        check_sglang_servers(clients[:1], load_config(None, ["rollout.server_urls=[http://a:1]"]))


def test_the_embedded_server_reports_sglang_fields(tiny_checkpoint):
    from fastapi.testclient import TestClient

    state = ServerState(ServerConfig(model_path=str(tiny_checkpoint)))
    with TestClient(create_app(state)) as app:
        info = app.get("/server_info").json()
        assert app.get("/get_server_info").json() == info
    assert set(info) <= set(ref.cli_flags()), sorted(set(info) - set(ref.cli_flags()))
    assert server_flag_errors(info, deterministic=True, routed_experts=False) == []
