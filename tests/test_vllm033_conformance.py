"""vLLM 0.33's rules the client and the weight push rely on, read from vLLM 0.33.0's own source
(``tests/vllm_reference.py``: its wheel, downloaded once into ``.cache``; nothing imported):

- a paused server (mode "abort" or "wait") refuses new requests with HTTP 503 and the message
  the client recognises (``rollout.engine.is_paused_reply``), and the stand-in of
  ``tests/test_client_retries.py`` answers exactly that;
- its weight transfer takes one sender per server, the reason a vLLM run at PP > 1 pushes from
  rank 0 alone (``rollout.engines.VLLM_SINGLE_SENDER``).
"""

from __future__ import annotations

import ast

import httpx
import pytest
import vllm_reference as ref
from test_client_retries import PausingVLLM

from megatron_sat.config import load_config
from megatron_sat.rollout.engine import VLLM_PAUSED_MESSAGE, is_paused_reply
from megatron_sat.rollout.engines import ENGINES
from megatron_sat.training.stage_senders import single_sender_reason, uses_stage_senders

pytestmark = pytest.mark.slow  # the first run downloads vLLM 0.33.0's wheel (336 MB)


def _functions(source: str, name: str) -> list[ast.FunctionDef]:
    return [
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name
    ]


def _function(source: str, name: str) -> ast.FunctionDef:
    (node,) = _functions(source, name)
    return node


def _call_keywords(node: ast.AST, callee: str) -> dict[str, object]:
    (call,) = [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == callee
    ]
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def test_a_paused_engine_refuses_new_requests_with_sglang_like_retryable_error():
    core = ref.source("v1/engine/core.py")
    reject = _function(core, "_reject_add_while_paused")
    assert _call_keywords(reject, "RequestError") == {
        "code": "engine_paused",
        "message": VLLM_PAUSED_MESSAGE,
        "retryable": True,
    }
    pause = ast.unparse(_function(core, "pause_generation"))
    assert "self.reject_new_requests = mode != 'keep'" in pause
    # EngineCoreProc's resume_scheduler (the base class's has no such flag).
    resumes = [ast.unparse(f) for f in _functions(core, "resume_scheduler")]
    assert any("self.reject_new_requests = False" in text for text in resumes)
    # The add path consults it for every new request.
    assert "self._reject_add_while_paused(req)" in core


def test_the_refusal_is_http_503_with_the_error_response_body():
    to_exception = ast.unparse(_function(ref.source("outputs.py"), "to_exception"))
    assert "if self.retryable:\n        return RetryableRequestError(self.message)" in to_exception
    exceptions = ref.source("exceptions.py")
    retryable = exceptions[exceptions.index("class RetryableRequestError") :]
    assert "self.status_code = HTTPStatus.SERVICE_UNAVAILABLE" in retryable.split("\nclass ")[0]
    response = ref.source("entrypoints/serve/exception_handling/error_response.py")
    assert (
        '"ServiceUnavailableError"\n                if isinstance(exc, RetryableRequestError)'
        in (response)
    )
    assert "error=ErrorInfo(\n            message=sanitize_message(message)" in response


def test_the_stand_in_answers_as_vllm_033_and_the_client_reads_it_as_paused():
    vllm = PausingVLLM()
    try:
        httpx.post(f"{vllm.server.url}/pause?mode=abort")
        reply = httpx.post(f"{vllm.server.url}/inference/v1/generate", json={})
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "ServiceUnavailableError"
        assert is_paused_reply(reply)
        httpx.post(f"{vllm.server.url}/pause?mode=keep")  # keep: no refusal
        assert httpx.post(f"{vllm.server.url}/inference/v1/generate", json={}).status_code == 200
    finally:
        vllm.server.close()
    # Another 503 (vLLM's overload rejections, engine/async_llm.py) is not a pause.
    other = httpx.Response(503, json={"error": {"message": "queue full", "code": 503}})
    assert not is_paused_reply(other)


def test_vllm_weight_transfer_has_one_sender_so_pp_runs_push_from_rank_0():
    nccl = ref.source("distributed/weight_transfer/nccl_engine.py")
    assert "NCCL broadcast has a single sender, " in nccl and "rank 0" in nccl
    init = ast.unparse(_function(nccl, "init_transfer_engine"))
    assert "self.model_update_group = worker_init_process_group(" in init  # one group, replaced
    worker = ref.source("v1/worker/gpu_worker.py")
    assert "self.weight_transfer_engine: WeightTransferEngine | None = None" in worker
    assert not ENGINES["vllm"].per_stage_push
    assert "single sender, rank 0" in ENGINES["vllm"].single_sender_reason
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "rollout.server_urls=[http://v:1]",
            "rollout.return_routed_experts=false",
            "train.use_r3=false",
            "launch.rollout_engine=vllm",
            "parallel.pipeline_model_parallel_size=2",
        ],
    )
    assert not uses_stage_senders(cfg)
    reason = single_sender_reason(cfg)
    assert reason.startswith("rollout.engine=vllm at pipeline_model_parallel_size=2: ")
    sglang = load_config(None, ["parallel.pipeline_model_parallel_size=2"])
    assert uses_stage_senders(sglang) and single_sender_reason(sglang) is None
