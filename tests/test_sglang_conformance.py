"""Conformance to SGLang 0.5.23, with SGLang's own code as the oracle.

``tests/sglang_reference.py`` installs ``sglang==0.5.23`` (no dependencies) into
``.cache/sglang-0.5.23`` and reads from it: the request structs of ``io_struct.py`` (their
source executed verbatim, validated through SGLang's own pydantic schema), the routes of
``http_server.py`` (decorators: path, methods, ``@auth_level``, body type), its
``decide_request_auth`` (``srt/utils/auth.py``, imported from the file) and its literal texts
and response key sets. Nothing of ours serves as the truth. The rules:

1. every request body the client sends (the push path included) validates against SGLang's
   request model of that route, with no field SGLang would ignore;
2. every endpoint + method the client and the launch scripts use is one SGLang registers, and
   every ``sglang.launch_server`` flag of the rendered scripts is one of SGLang's server args;
3. the embedded server's responses have SGLang's field names, nesting and types, and its
   error texts are SGLang's;
4. the embedded server's auth decisions equal SGLang's ``decide_request_auth`` on every
   endpoint, for every key configuration;

plus SGLang's protocol as the embedded server and the push path now follow it: the weight
update session (and a failure inside it), ``/health`` while paused, ``/flush_cache`` while
requests run, the fleet's probe of a paused server, and acceptance: a server started with keys
answers 401 without them and no key reaches its log or a rendered script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import sglang_reference as ref
import torch
import yaml
from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from safetensors.torch import load_file

from megatron_sat.rollout.auth import (
    ENDPOINT_AUTH_LEVELS,
    AuthLevel,
    ServerKeys,
    decide_request_auth,
    load_server_keys,
)
from megatron_sat.rollout.client import RoutingSpec, SamplingParams, SGLangClient
from megatron_sat.rollout.embedded.launch import EmbeddedServer
from megatron_sat.rollout.embedded.server import (
    FLUSH_AFTER_UPDATE_FAILED,
    FLUSH_FAILED,
    FLUSH_OK,
    OUTSIDE_SESSION,
    ServerConfig,
    ServerState,
    create_app,
    parse_args,
)
from megatron_sat.rollout.fleet import RolloutFleet
from megatron_sat.routing.payload import encode_routed_experts
from megatron_sat.weight_sync.broadcast import WeightSyncError, WeightUpdater

ROOT = Path(__file__).resolve().parents[1]
RENDERED = ROOT / "examples" / "rendered"
API_KEY, ADMIN_KEY = "api-key-for-tests-7f3a", "admin-key-for-tests-91c2"
KEYS = ServerKeys(API_KEY, ADMIN_KEY)
ROUTING = RoutingSpec(num_layers=2, top_k=2, num_experts=8)


@pytest.fixture(scope="module", autouse=True)
def sglang_source():
    return ref.ensure_sglang()


class RecordingClient(SGLangClient):
    """An SGLangClient that records (method, endpoint, body, Authorization) of every call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str, object, str | None]] = []

    def _request(self, method, endpoint, body, *, retry=False):
        self.calls.append(
            (method, endpoint, body, self.keys.header_for(endpoint).get("Authorization"))
        )
        return super()._request(method, endpoint, body, retry=retry)

    def endpoints(self) -> list[str]:
        return [endpoint for _, endpoint, _, _ in self.calls]


def _fake_reply(path: str, body: dict | None) -> dict:
    if path == "/generate":
        prompt = body["input_ids"]
        meta = {
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": "3",
            "output_token_logprobs": [[-0.5, 7, None]],
        }
        if body.get("return_routed_experts"):
            start = body["routed_experts_start_len"]
            routes = np.zeros((len(prompt) + 1 - 1 - start, 2, 2), dtype=np.uint8)
            meta["routed_experts"] = encode_routed_experts(routes)
        return {"output_ids": [7], "meta_info": meta}
    if path == "/model_info":
        return {"weight_version": "3"}
    return {"success": True, "message": "Success"}


@pytest.fixture(scope="module")
def client_calls() -> list[tuple[str, str, object, str | None]]:
    """Every call of the client's API, against a recording transport (one per method)."""
    client = RecordingClient("http://sglang.test", keys=KEYS)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        return httpx.Response(200, json=_fake_reply(request.url.path, body))

    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(handler))
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=1)
    client.generate([3, 4, 5], sampling, routing=ROUTING, routed_experts_start_len=1)
    client.generate([3, 4, 5], sampling, return_logprob=True)
    client.get_weight_version()
    client.get_server_info()
    for mode in ("abort", "retract", "in_place"):
        client.pause_generation(mode)
    client.continue_generation()
    client.flush_cache()
    client.init_weights_update_group("127.0.0.1", 29500, 1, 2, "g", "gloo")
    client.begin_weight_update()
    for flush, version, load_format in ((True, "3", "flattened_bucket"), (False, None, None)):
        client.update_weights_from_distributed(
            ["a.weight"],
            ["bfloat16"],
            [[2, 3]],
            group_name="g",
            weight_version=version,
            flush_cache=flush,
            load_format=load_format,
        )
    client.end_weight_update()
    client.destroy_weights_update_group("g")
    assert client.alive() and client.health()
    return client.calls


# ---- a live embedded server with keys, and pushes through it --------------------------------


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint):
    with EmbeddedServer(
        str(tiny_checkpoint),
        keys=KEYS,
        dist_timeout_s=60,
        env={"SGLANG_HEALTH_CHECK_TIMEOUT": "0.5"},
    ) as server:
        yield server


def _tensors(tiny_checkpoint: Path, shift: float) -> list[tuple[str, torch.Tensor]]:
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    return [(name, t + shift) for name, t in sorted(tensors.items())]


@pytest.fixture(scope="module")
def pushes(keyed_server, tiny_checkpoint):
    """One push per pause mode (two buckets each), then one that fails in its second bucket.

    Returns {mode: the calls the push made}, with "failed" for the failing one and
    "after_failure" for a push right after it.
    """
    out = {}
    client = RecordingClient(keyed_server.url, keys=KEYS)
    tensors = _tensors(tiny_checkpoint, 0.01)
    half = sum(t.numel() * t.element_size() for _, t in tensors) // 2
    for i, mode in enumerate(("abort", "retract", "in_place")):
        with WeightUpdater([client], bucket_bytes=half + 1, pause_mode=mode, timeout_s=60) as up:
            client.calls.clear()
            up.update(tensors, weight_version=f"v{i}")
            out[mode] = list(client.calls)
            assert client.get_weight_version() == f"v{i}"
            name, tensor = tensors[-1]
            bad = [*tensors[:-1], (name, tensor[..., :-1].contiguous())]  # last bucket rejected
            client.calls.clear()
            if mode == "in_place":
                with pytest.raises(WeightSyncError, match="rejected 1 parameter"):
                    up.update(bad, weight_version="never")
                out["failed"] = list(client.calls)
                out["version_after_failure"] = client.get_weight_version()
                client.calls.clear()
                up.update(tensors, weight_version="v9")
                out["after_failure"] = list(client.calls)
    return out


# ---- rule 1: request bodies validate against SGLang's models -------------------------------


def _check_body(method: str, endpoint: str, body) -> None:
    route = ref.route(endpoint, method)
    assert route is not None, f"{method} {endpoint} is not an SGLang route"
    structs = ref.structs()
    if route.body_type in structs:
        model = structs[route.body_type]
        fields = set(model.__struct_fields__)
        sent = set(body or {})
        assert sent <= fields, f"{endpoint}: SGLang ignores {sorted(sent - fields)}"
        TypeAdapter(model).validate_python(body or {})
    elif route.body_type == "GenerateReqInput":
        fields = ref.class_fields("srt/managers/io_struct.py", "GenerateReqInput")
        assert set(body) <= set(fields), (
            f"/generate: SGLang has no {sorted(set(body) - set(fields))}"
        )
        for key, value in body.items():
            TypeAdapter(fields[key].annotation).validate_python(value)
        sampling = ref.class_fields("srt/sampling/sampling_params.py", "SamplingParams")
        params = body["sampling_params"]
        assert set(params) <= set(sampling), (
            f"SamplingParams has no {sorted(set(params) - set(sampling))}"
        )
        for key, value in params.items():
            TypeAdapter(sampling[key].annotation).validate_python(value)
    else:
        assert body is None, f"{endpoint} takes no JSON body in SGLang, we sent {body!r}"


def test_client_request_bodies_validate_against_sglang_models(client_calls):
    """Rule 1 for every client method (recording transport)."""
    assert {e for _, e, _, _ in client_calls} == set(ENDPOINT_AUTH_LEVELS) - {
        "/health",  # GET without body, sent outside _request (checked by rule 2)
        "/health_generate",
        "/ready",
        "/get_server_info",  # /server_info's deprecated alias, served by the embedded server
    }
    for method, endpoint, body, _ in client_calls:
        _check_body(method, endpoint, body)


def test_push_request_bodies_validate_against_sglang_models(pushes):
    """Rule 1 for what the push path really sends (WeightUpdater against the server)."""
    for calls in (pushes["abort"], pushes["retract"], pushes["in_place"], pushes["failed"]):
        for method, endpoint, body, _ in calls:
            _check_body(method, endpoint, body)


# ---- rule 2: endpoints, methods and launch flags are SGLang's -------------------------------


def test_endpoints_and_methods_used_are_registered_by_sglang(client_calls, pushes):
    used = {(m, e) for m, e, _, _ in client_calls}
    used |= {(m, e) for calls in pushes.values() if isinstance(calls, list) for m, e, _, _ in calls}
    used |= {("GET", "/health"), ("GET", "/model_info")}  # fleet probes, EmbeddedServer start
    for name in ("torchrun.sh", "job.sbatch", "mpirun.sh"):
        text = (RENDERED / name).read_text()
        # HEALTH_PY: urllib's GET of URL/health
        assert 'urllib.request.urlopen(sys.argv[1] + "/health"' in text
        used |= {("GET", e) for e in re.findall(r'sys\.argv\[1\] \+ "(/[a-z_]+)"', text)}
    missing = sorted((m, e) for m, e in used if ref.route(e, m) is None)
    assert not missing, f"not registered by SGLang 0.5.23: {missing}"
    assert ("POST", "/begin_weight_update") in used and ("POST", "/end_weight_update") in used


def test_rendered_sglang_flags_are_sglang_server_args():
    fields = set()
    for path in (ref.ensure_sglang() / "srt/arg_groups/fields").glob("*.py"):
        fields |= {
            line.split(":")[0].strip()
            for line in path.read_text().splitlines()
            if re.match(r"    [a-z_0-9]+: ", line)
        }
    assert '"--config"' in ref.source("srt/server_args.py")  # the YAML of flags
    fields.add("config")
    for name in ("torchrun.sh", "job.sbatch", "mpirun.sh"):
        for line in (RENDERED / name).read_text().splitlines():
            if "-m sglang.launch_server" not in line:
                continue
            args = line.split("-m sglang.launch_server", 1)[1]
            flags = {f.replace("-", "_") for f in re.findall(r" --([a-z][a-z0-9-]*)", args)}
            unknown = flags - fields
            assert not unknown, f"{name}: sglang.launch_server has no {sorted(unknown)}"


# ---- rule 3: the embedded server's responses are shaped as SGLang's -------------------------


def _route_key_sets(path: str, method: str = "POST") -> list[frozenset[str]]:
    return ref.dict_key_sets(ref.route(path, method).node)


def _check_struct_reply(path: str, reply: dict, struct: str) -> None:
    model = ref.structs()[struct]
    base = set(ref.structs()["BaseReq"].__struct_fields__)
    assert set(reply) == set(model.__struct_fields__) - base, (path, reply)
    assert frozenset(reply) in _route_key_sets(path)
    TypeAdapter(model).validate_python(reply, strict=True)


@pytest.fixture(scope="module")
def state(tiny_checkpoint):
    return ServerState(ServerConfig(model_path=str(tiny_checkpoint), health_check_timeout_s=0.3))


@pytest.fixture()
def app(state):
    state.config = ServerConfig(model_path=state.config.model_path, health_check_timeout_s=0.3)
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        try:
            yield client
        finally:  # before the client closes: it waits for a request suspended in place
            state.scheduler.resume()
            state.session = None


def test_embedded_responses_have_sglang_fields(app):
    gen = app.post(
        "/generate",
        json={
            "input_ids": [3, 4, 5],
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
        },
    ).json()
    constants = ref.string_constants("srt/managers/tokenizer_manager.py")
    assert set(gen) == {"output_ids", "meta_info"} and set(gen) <= constants
    meta = gen["meta_info"]
    # The tokenizer manager's keys, and the spans' (srt/utils/weight_versions.py
    # add_weight_versions_to_meta_info, which it calls).
    constants |= ref.string_constants("srt/utils/weight_versions.py")
    assert set(meta) <= constants, sorted(set(meta) - constants)
    assert meta["weight_versions"] == [
        {"version": meta["weight_version"], "start": 0, "end": len(gen["output_ids"])}
    ]
    assert frozenset(meta["finish_reason"]) in ref.finish_reason_key_sets()
    logprob, token, text = meta["output_token_logprobs"][0]
    assert isinstance(logprob, float) and isinstance(token, int) and text is None
    assert isinstance(meta["weight_version"], str) and isinstance(meta["prompt_tokens"], int)

    info = app.get("/model_info").json()
    sglang_keys = max(_route_key_sets("/model_info", "GET"), key=len)
    assert set(info) <= sglang_keys, sorted(set(info) - sglang_keys)
    assert isinstance(info["weight_version"], str) and isinstance(info["is_generation"], bool)

    for path in ("/pause_generation", "/continue_generation"):
        reply = app.post(path, json={"mode": "retract"} if "pause" in path else {}).json()
        assert frozenset(reply) in _route_key_sets(path) and reply["status"] == "ok"

    for path, body, struct in (
        ("/begin_weight_update", {"selector": "all"}, "BeginWeightUpdateReqOutput"),
        ("/begin_weight_update", {}, "BeginWeightUpdateReqOutput"),  # already open: 400
        ("/end_weight_update", {}, "EndWeightUpdateReqOutput"),
        ("/end_weight_update", {}, "EndWeightUpdateReqOutput"),  # none open: 400
        (
            "/update_weights_from_distributed",
            {"names": [], "dtypes": [], "shapes": []},
            "UpdateWeightsFromDistributedReqOutput",
        ),
        (
            "/destroy_weights_update_group",
            {"group_name": "nope"},
            "DestroyWeightsUpdateGroupReqOutput",
        ),
    ):
        response = app.post(path, json=body)
        _check_struct_reply(path, response.json(), struct)
        assert response.status_code == (200 if response.json()["success"] else 400)


def test_embedded_error_texts_are_sglang_s(app):
    """The session refusals, flush texts and auth bodies are SGLang's literal strings."""
    updater_texts = ref.string_constants("srt/managers/scheduler_components/weight_updater.py")
    assert OUTSIDE_SESSION in updater_texts
    reply = app.post(
        "/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": []}
    )
    assert reply.status_code == 400 and reply.json() == {
        "success": False,
        "message": OUTSIDE_SESSION,
    }
    assert app.post("/begin_weight_update", json={}).json()["success"]
    assert app.post("/begin_weight_update", json={}).json()["message"] in updater_texts
    assert app.post("/end_weight_update", json={}).json()["success"]
    assert app.post("/end_weight_update", json={}).json()["message"] in updater_texts
    server_texts = ref.string_constants("srt/entrypoints/http_server.py")
    assert FLUSH_OK in server_texts and FLUSH_FAILED in server_texts
    assert {"Unauthorized", "Forbidden"} <= ref.string_constants("srt/utils/auth.py")


# ---- rule 4: auth decisions are SGLang's ----------------------------------------------------


def test_endpoint_auth_levels_are_sglang_s():
    for path, level in ENDPOINT_AUTH_LEVELS.items():
        routes = [r for r in ref.routes() if r.path == path]
        assert routes, f"{path} is not an SGLang route"
        assert {r.auth_level for r in routes} == {level.value}, path


KEY_CONFIGS = [(None, None), (API_KEY, None), (None, ADMIN_KEY), (API_KEY, ADMIN_KEY)]
HEADERS = [
    None,
    f"Bearer {API_KEY}",
    f"Bearer {ADMIN_KEY}",
    f"bearer {API_KEY}",
    f"Bearer {API_KEY}x",
    f"Basic {API_KEY}",
    "Bearer",
]


def test_auth_decisions_equal_sglang_decide_request_auth():
    """Our rule against SGLang's function, on every SGLang route and level, every key set."""
    sg = ref.auth_module()
    cases = 0
    for r in ref.routes():
        for method in sorted(r.methods) + ["OPTIONS"]:
            for (api, admin), header, level in itertools.product(KEY_CONFIGS, HEADERS, AuthLevel):
                theirs = sg.decide_request_auth(
                    method=method,
                    path=r.path,
                    authorization_header=header,
                    api_key=api,
                    admin_api_key=admin,
                    auth_level=sg.AuthLevel(level.value),
                )
                ours = decide_request_auth(
                    method=method,
                    path=r.path,
                    authorization_header=header,
                    api_key=api,
                    admin_api_key=admin,
                    auth_level=level,
                )
                assert (ours.allowed, ours.error_status_code) == (
                    theirs.allowed,
                    theirs.error_status_code,
                ), (method, r.path, api, admin, header, level)
                cases += 1
    assert cases > 10000


# A request per served endpoint that has no effect when it is let through.
HARMLESS = {
    "/health": ("GET", None),
    "/health_generate": ("GET", None),
    "/ready": ("GET", None),
    "/model_info": ("GET", None),
    "/server_info": ("GET", None),
    "/get_server_info": ("GET", None),
    "/generate": ("POST", {}),
    "/flush_cache": ("POST", None),
    "/pause_generation": ("POST", {"mode": "no-such-mode"}),
    "/continue_generation": ("POST", {}),
    "/init_weights_update_group": ("POST", {}),
    "/destroy_weights_update_group": ("POST", {"group_name": "nope"}),
    "/begin_weight_update": ("POST", {"selector": "no-such-selector"}),
    "/end_weight_update": ("POST", {}),
    "/update_weights_from_distributed": ("POST", {}),
}


def test_embedded_server_auth_equals_sglang_on_every_endpoint(state):
    """The served app's answers (in-process) against SGLang's decision, per key configuration."""
    sg = ref.auth_module()
    docs = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's own
    served = {r.path for r in create_app(state).routes if hasattr(r, "methods")} - docs
    assert set(HARMLESS) == served == set(ENDPOINT_AUTH_LEVELS)
    for api, admin in KEY_CONFIGS:
        state.config = ServerConfig(
            model_path=state.config.model_path,
            api_key=api,
            admin_api_key=admin,
            health_check_timeout_s=0.3,
        )
        with TestClient(create_app(state), raise_server_exceptions=False) as app:
            for path, (method, body) in HARMLESS.items():
                level = ref.route(path, method).auth_level
                for header in HEADERS:
                    theirs = sg.decide_request_auth(
                        method=method,
                        path=path,
                        authorization_header=header,
                        api_key=api,
                        admin_api_key=admin,
                        auth_level=sg.AuthLevel(level),
                    )
                    headers = {} if header is None else {"Authorization": header}
                    response = app.request(method, path, json=body, headers=headers)
                    if theirs.allowed:
                        assert response.status_code not in (401, 403), (path, api, admin, header)
                    else:
                        expected = (
                            "Unauthorized" if theirs.error_status_code == 401 else "Forbidden"
                        )
                        assert response.status_code == theirs.error_status_code, (path, header)
                        assert response.json() == {"error": expected}
    state.config = ServerConfig(model_path=state.config.model_path, health_check_timeout_s=0.3)


# ---- SGLang's protocol: sessions, /health while paused, /flush_cache while running ---------


def test_push_wraps_every_update_in_a_session_in_sglang_order(pushes):
    for mode in ("abort", "retract", "in_place"):
        calls = pushes[mode]
        endpoints = [e for _, e, _, _ in calls]
        num_buckets = endpoints.count("/update_weights_from_distributed")
        assert num_buckets >= 2
        assert endpoints == [
            "/pause_generation",
            "/begin_weight_update",
            *["/update_weights_from_distributed"] * num_buckets,
            "/end_weight_update",
            "/continue_generation",
        ], mode
        assert calls[0][2] == {"mode": mode}
        flushes = [
            body["flush_cache"] for _, e, body, _ in calls if e.startswith("/update_weights")
        ]
        versions = [body["weight_version"] for _, e, body, _ in calls if e.startswith("/update")]
        # SGLang's flush after loading fails while in-place-paused requests hold the batch.
        assert flushes == [False] * (num_buckets - 1) + [mode != "in_place"], mode
        assert versions[:-1] == [None] * (num_buckets - 1) and versions[-1] is not None
        # Admin routes carry the admin key, SGLang's rule when both keys are set.
        assert all(auth == f"Bearer {ADMIN_KEY}" for _, _, _, auth in calls)


def test_failed_update_ends_the_session_and_keeps_the_version(pushes):
    endpoints = [e for _, e, _, _ in pushes["failed"]]
    assert endpoints[:2] == ["/pause_generation", "/begin_weight_update"]
    assert endpoints[-1] == "/end_weight_update"  # left paused: the first bucket was applied
    assert pushes["version_after_failure"] == "v2"
    # The next update could open a session: the failed one had ended it.
    assert [e for _, e, _, _ in pushes["after_failure"]][1] == "/begin_weight_update"
    assert pushes["after_failure"][-1][1] == "/continue_generation"


def test_health_waits_while_paused_then_503(app):
    assert app.get("/health").status_code == 200
    app.post("/pause_generation", json={"mode": "abort"})
    start = time.monotonic()
    assert app.get("/health").status_code == 503
    assert app.get("/health_generate").status_code == 503
    assert time.monotonic() - start >= 2 * 0.3
    assert app.get("/ready").status_code == 503
    assert app.get("/model_info").status_code == 200  # answered while paused
    app.post("/continue_generation", json={})
    assert app.get("/health").status_code == 200 and app.get("/ready").status_code == 200


def test_flush_cache_refused_while_requests_run_in_place(app, state):
    result = {}

    def generate() -> None:
        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 120}}
        result["reply"] = app.post("/generate", json=body)

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while not state.scheduler._running and time.monotonic() < deadline:
        time.sleep(0.001)
    app.post("/pause_generation", json={"mode": "in_place"})
    try:
        assert state.scheduler.busy(), "the request finished before the pause; make it longer"
        refused = app.post("/flush_cache")
        assert (refused.status_code, refused.text) == (400, FLUSH_FAILED)
    finally:
        app.post("/continue_generation", json={})
        thread.join(60)
    reply = result["reply"].json()
    assert reply["meta_info"]["finish_reason"]["type"] in ("length", "stop")  # not aborted
    # The reply can arrive before the scheduler has retired its batch (seen under CI load).
    deadline = time.monotonic() + 30
    while state.scheduler.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    done = app.post("/flush_cache")
    assert (done.status_code, done.text) == (200, FLUSH_OK)


def test_a_push_during_an_in_place_pause_splits_the_spans_as_sglang(app, state):
    """A request suspended in place across a weight update continues with the new weights: its
    output's weight_versions spans (SGLang 0.5.23: record_weight_version_events at the update,
    compute_weight_version_spans at the end) give the old version to the tokens before the
    pause and the new one to the rest, and the client reads them per token."""
    result = {}

    def generate() -> None:
        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 120}}
        result["reply"] = app.post("/generate", json=body)

    old = state.scheduler.weight_version
    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while not state.scheduler._running and time.monotonic() < deadline:
        time.sleep(0.001)
    app.post("/pause_generation", json={"mode": "in_place"})
    try:
        assert state.scheduler.busy(), "the request finished before the pause; make it longer"
        with state.scheduler.model_lock:  # as an update does
            state.scheduler.weight_version = "pushed"
    finally:
        app.post("/continue_generation", json={})
        thread.join(60)
    try:
        reply = result["reply"].json()
        n = len(reply["output_ids"])
        spans = reply["meta_info"]["weight_versions"]
        assert [span["version"] for span in spans] == [old, "pushed"]
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
        assert spans[1]["end"] == n > spans[1]["start"]
        assert reply["meta_info"]["weight_version"] == "pushed"
        # The per-token versions the client gives the pool.
        meta = {
            **reply["meta_info"],
            "output_token_logprobs": [[0.0, t, None] for t in reply["output_ids"]],
        }
        client = SGLangClient("http://embedded.test")
        client._http = httpx.Client(
            base_url="http://embedded.test",
            transport=httpx.MockTransport(
                lambda request: httpx.Response(200, json={**reply, "meta_info": meta})
            ),
        )
        (out,) = client.generate([3, 4, 5], SamplingParams(max_new_tokens=120))
        cut = spans[0]["end"]
        assert out.token_versions() == [old] * cut + ["pushed"] * (n - cut)
    finally:
        state.scheduler.weight_version = old


def test_fleet_keeps_a_paused_server_alive_after_a_failed_push(keyed_server, tiny_checkpoint):
    """A push that fails after a bucket loaded leaves the server paused (its /health then
    answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT): the fleet must probe /model_info."""
    client = keyed_server.client()
    tensors = _tensors(tiny_checkpoint, 0.02)
    half = sum(t.numel() * t.element_size() for _, t in tensors) // 2
    name, tensor = tensors[-1]
    bad = [*tensors[:-1], (name, tensor[..., :-1].contiguous())]
    fleet = RolloutFleet(
        [client],
        servers=[keyed_server],
        updater_options={"bucket_bytes": half + 1, "timeout_s": 60},
    )
    try:
        with pytest.raises(WeightSyncError, match="stay paused"):
            fleet.push(lambda: bad, 11)
        assert fleet.live == {0} and not client.health(timeout_s=5)  # paused, alive
        report = fleet.push(lambda: tensors, 12)
        assert report.found_dead == () and client.get_weight_version() == "12"
        assert client.health(timeout_s=5)
    finally:
        fleet.close()


# ---- acceptance: keys -----------------------------------------------------------------------


def test_server_with_keys_refuses_without_them(keyed_server):
    """Without a key every endpoint answers 401, except those SGLang always lets through
    (/health*, /ready: k8s probes); admin endpoints refuse the API key too (both keys set)."""
    url = keyed_server.url
    for path, (method, body) in HARMLESS.items():
        response = httpx.request(method, url + path, json=body, timeout=30)
        if path.startswith(("/health", "/ready")):
            assert response.status_code == 200, path
            continue
        assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"}), path
        if ENDPOINT_AUTH_LEVELS[path] == AuthLevel.ADMIN_OPTIONAL:
            with_api = httpx.request(
                method, url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}
            )
            assert with_api.status_code == 401, path
    normal = httpx.get(url + "/model_info", headers={"Authorization": f"Bearer {API_KEY}"})
    assert normal.status_code == 200
    # ... and the keys never reach the server's log, nor its command line.
    log = keyed_server.log_tail(10**7)
    assert API_KEY not in log and ADMIN_KEY not in log
    assert not any(API_KEY in a or ADMIN_KEY in a for a in keyed_server.command(1234))


def test_rendered_scripts_hold_no_key_and_generate_a_private_key_file(tmp_path):
    """Keys exist only at run time: the scripts' text holds none; the key snippet of a keyed
    script, run here, makes a 0600 file our loader accepts, and the log filter redacts."""
    text = (RENDERED / "mpirun.sh").read_text()
    assert "api_key:" not in text and "--api-key" not in text and "--admin-api-key" not in text
    assert '--config "$KEY_FILE"' in text and '"rollout.server_key_file=$KEY_FILE"' in text
    for name in ("torchrun.sh", "job.sbatch"):  # one node: loopback, no keys
        single = (RENDERED / name).read_text()
        assert "--host 127.0.0.1" in single and "KEY_FILE=" not in single
        assert "0.0.0.0" not in single
    start = text.index("KEYGEN_PY=")
    snippet = text[start : text.index("\n\n", start)]
    log = tmp_path / "server.log"
    script = (
        f"set -euo pipefail\nPY={sys.executable}\nLOG_DIR={tmp_path}\n{snippet}\n"
        'echo "server_args={\'api_key\': \'$(sed -n 1p "$KEY_FILE" | cut -d" " -f2)\'}" '
        f'| "$PY" -u -c "$REDACT_PY" "$KEY_FILE" > {log}\necho "$KEY_FILE"\n'
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    key_file = Path(out.stdout.strip())
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    keys = load_server_keys(key_file)
    assert len(keys.api_key) >= 32 and len(keys.admin_api_key) >= 32
    assert keys.api_key not in out.stdout + out.stderr
    assert log.read_text() == "server_args={'api_key': '<redacted>'}\n"
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="must be 0600"):
        load_server_keys(key_file)


def test_generated_keys_survive_sglang_config_merge(monkeypatch, capsys, tmp_path):
    """SGLang re-parses each ``--config`` entry ``k: v`` as ``--k v`` with its own merger: the
    rendered key file must spell the flags (``api-key``; ``--api_key`` is unrecognised), and a
    key from the worst draw of ``token_urlsafe`` (a leading ``-``, which argparse takes for an
    option) must still parse. The parser registers the flags as SGLang's does (``--api-key``)."""
    text = (RENDERED / "mpirun.sh").read_text()
    start = text.index("KEYGEN_PY='") + len("KEYGEN_PY='")
    code = text[start : text.index("'\n", start)]
    fake = types.SimpleNamespace(token_urlsafe=lambda n: "-" + "A" * 42)
    monkeypatch.setitem(sys.modules, "secrets", fake)
    exec(code, {})
    yaml_text = capsys.readouterr().out
    monkeypatch.undo()
    merger_module = ref.load_module(
        "srt/utils/server_args_config_parser.py", "_sglang_ref_config_parser"
    )
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key", type=str, default=None)
    parser.add_argument("--admin-api-key", type=str, default=None)
    parser.add_argument("--config", type=str, default=None)
    config = tmp_path / "keys.yaml"
    config.write_text(yaml_text)
    argv = merger_module.ConfigArgumentMerger(parser).merge_config_with_args(
        ["--config", str(config)]
    )
    args = parser.parse_args(argv)
    assert args.api_key == "sk--" + "A" * 42 and args.admin_api_key == args.api_key


@pytest.mark.parametrize("odd", ["yes", "0123", "a #b", "-lead", "x: y", "'q\"", "~", "null"])
def test_embedded_key_file_keeps_odd_keys(tmp_path, odd):
    """Keys that YAML would read as another value (bool, octal, comment, mapping) reach the
    embedded server's --config parse unchanged, as SGLang's merger would read them."""
    server = EmbeddedServer(tmp_path / "model", keys=ServerKeys(odd, odd + "2"))
    key_file = server._key_file()
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    config = parse_args(["--model-path", "m", "--config", str(key_file)])
    assert (config.api_key, config.admin_api_key) == (odd, odd + "2")
    assert load_server_keys(key_file) == ServerKeys(odd, odd + "2")
    key_file.unlink()
    server.log_path.unlink()


@pytest.mark.parametrize("fail_after", [1, 4])
def test_update_whose_tensor_source_fails_ends_its_session(
    keyed_server, tiny_checkpoint, fail_after
):
    """The tensors come from a generator (megatron_push gathers them with collectives); when it
    raises mid-update, the session still ends, so the next update can begin one. Nothing
    loaded (failure before the first bucket went out): generation resumes; else the server
    stays paused, as after a rejected bucket."""
    client = RecordingClient(keyed_server.url, keys=KEYS)
    tensors = _tensors(tiny_checkpoint, 0.0)
    smallest = min(t.numel() * t.element_size() for _, t in tensors)

    def source():
        yield from tensors[:fail_after]
        raise RuntimeError("gather collective failed")

    with WeightUpdater([client], bucket_bytes=smallest, pause_mode="retract", timeout_s=60) as up:
        version = client.get_weight_version()
        client.calls.clear()
        with pytest.raises(RuntimeError, match="gather collective failed"):
            up.update(source(), weight_version="never")
        endpoints = [e for _, e, _, _ in client.calls]
        assert endpoints[:2] == ["/pause_generation", "/begin_weight_update"]
        loaded = endpoints.count("/update_weights_from_distributed")
        # Every bucket the source completed went out (a bucket is complete once the next
        # tensor is read: the one that raised completes none): buckets 0 .. fail_after - 2.
        assert loaded == max(0, fail_after - 1)
        assert endpoints[-1] == ("/end_weight_update" if loaded else "/continue_generation")
        assert "/end_weight_update" in endpoints
        assert client.get_weight_version() == version
        up.update(tensors, weight_version=f"{version}-again")  # a new session opens
        assert client.get_weight_version() == f"{version}-again"


@pytest.mark.parametrize("bad", ["SECRET\n", " SECRET", "SECRET\t", "SECRETü", "", "SE\x00CRET"])
def test_keys_that_http_or_sglang_cannot_carry_are_refused_unseen(tmp_path, bad):
    """A control character makes httpx raise with the header (the key) in its message, HTTP
    servers strip surrounding whitespace, and SGLang's compare_digest raises on non-ASCII:
    refused at once, without the key in the error."""
    with pytest.raises(ValueError, match="ServerKeys.admin_api_key must be") as info:
        ServerKeys("fine", bad)
    assert "SECRET" not in str(info.value)
    key_file = tmp_path / "keys.yaml"
    key_file.write_text(yaml.safe_dump({"api-key": "fine", "admin-api-key": bad}))
    key_file.chmod(0o600)
    with pytest.raises(ValueError):
        load_server_keys(key_file)


def test_update_whose_flush_fails_records_its_version_as_sglang(state, monkeypatch):
    """SGLang 0.5.23's update_weights_from_distributed loads, records weight_version, then
    flushes; a refused flush fails the call with the new version already recorded."""
    source = ref.source("srt/managers/scheduler_components/weight_updater.py")
    assert source.index("self.record_weight_version_after_update(recv_req.weight_version)") < (
        source.index("success, message = self.flush_cache_after_weight_update(")
    )
    name, target = next(iter(state.engine.weight_targets.items()))
    original, version = target.detach().clone(), state.scheduler.weight_version

    class Group:
        def broadcast(self, buf, src, async_op):
            buf.copy_(original)
            return types.SimpleNamespace(wait=lambda: None)

    body = {
        "group_name": "flush_test",
        "names": [name],
        "dtypes": [str(target.dtype).removeprefix("torch.")],
        "shapes": [list(target.shape)],
        "weight_version": "after-refused-flush",
        "flush_cache": True,
    }
    state.groups["flush_test"] = Group()
    monkeypatch.setattr(state.scheduler, "busy", lambda: True)
    try:
        fatal, specs, mismatches = state.check_update(body)
        assert fatal is None and not mismatches
        assert state.receive_update(body, specs, mismatches) == (False, FLUSH_AFTER_UPDATE_FAILED)
        assert state.scheduler.weight_version == "after-refused-flush"
    finally:
        del state.groups["flush_test"]
        state.scheduler.weight_version = version
