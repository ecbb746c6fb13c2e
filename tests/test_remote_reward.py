"""The remote reward scorer (``rollout.reward=http``) against a loopback server: batching, the
schema, the API key, retries of a slow and of a failing request, and a scorer that stays down."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_sat.config.run import RolloutConfig
from megatron_sat.rollout.remote_reward import RemoteReward, RemoteRewardError
from megatron_sat.rollout.reward_choice import open_reward
from megatron_sat.rollout.reward_plugins import RewardPluginError, RewardResult


class Scorer(ThreadingHTTPServer):
    """Scores each item as len(response) with metric ``batch`` (the request's item count).
    ``script`` gives, per request in arrival order, what to do instead of answering: a float
    sleeps that long first (a slow request), an int answers that HTTP status."""

    daemon_threads = True

    def __init__(self, script=()):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = list(script)
        self.bodies: list[dict] = []
        self.headers_seen: list[dict] = []
        self.lock = threading.Lock()
        self.reply_scores = None  # to override the scores list
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server: Scorer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.bodies.append(body)
            server.headers_seen.append(dict(self.headers))
            action = server.script.pop(0) if server.script else None
        if isinstance(action, float):
            time.sleep(action)
        elif isinstance(action, bytes):  # this reply, as is
            self._reply(200, action)
            return
        elif action == "drip":  # a valid reply, one byte per 0.2 s
            data = json.dumps({"scores": [1.0] * len(body["items"])}).encode() + b" " * 20
            self._reply(200, data, drip_s=0.2)
            return
        elif isinstance(action, int):
            self._reply(action, b"scorer overloaded")
            return
        items = body["items"]
        scores = server.reply_scores or [
            {"score": float(len(i["response"])), "batch": len(items)} for i in items
        ]
        self._reply(200, json.dumps({"scores": scores}).encode())

    def _reply(self, status: int, data: bytes, drip_s: float = 0.0) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not drip_s:
                self.wfile.write(data)
            for i in range(len(data) if drip_s else 0):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(drip_s)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass


@pytest.fixture
def scorer_factory():
    servers = []

    def make(script=()):
        servers.append(Scorer(script))
        return servers[-1]

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def _client(url: str, **kw) -> RemoteReward:
    kw = {"batch_size": 3, "timeout_s": 0.5, "max_retries": 3, "backoff_s": 0.01, **kw}
    return RemoteReward(url, max_wait_s=0.2, **kw)


def test_batches_follow_the_schema_and_scores_come_back_in_order(scorer_factory):
    scorer = scorer_factory()
    with _client(scorer.url, api_key="sekret") as reward:
        futures = [reward.submit("x" * n, f"l{n}", f"p{n}", {"n": n}) for n in range(5)]
        results = [f.result(timeout=30) for f in futures]
    assert [r.score for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [len(b["items"]) for b in scorer.bodies] == [3, 2]  # batch_size 3
    assert scorer.bodies[0]["items"][1] == {
        "prompt": "p1",
        "response": "x",
        "label": "l1",
        "metadata": {"n": 1},
    }
    assert results[4] == RewardResult(4.0, {"batch": 2.0})
    assert {h["Authorization"] for h in scorer.headers_seen} == {"Bearer sekret"}


def test_a_slow_and_a_failing_request_are_retried_and_the_batch_finishes(scorer_factory):
    # 1st request: slower than the 0.5 s timeout; its retry: HTTP 503; the next one answers.
    scorer = scorer_factory(script=[2.0, 503])
    with _client(scorer.url) as reward:
        futures = [reward.submit("y" * n, "l", "p") for n in range(3)]
        assert [f.result(timeout=30).score for f in futures] == [0.0, 1.0, 2.0]
        assert reward.retries == 2
    assert len(scorer.bodies) == 3 and all(b == scorer.bodies[0] for b in scorer.bodies)


def test_a_scorer_that_stays_down_fails_every_sample_with_a_clear_error(scorer_factory):
    scorer = scorer_factory(script=[503] * 10)
    with _client(scorer.url, max_retries=2) as reward:
        future = reward.submit("r", "l", "p")
        with pytest.raises(RemoteRewardError, match=r"scorer http://127.0.0.1:\d+/score failed 3 "):
            future.result(timeout=30)
    assert len(scorer.bodies) == 3
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _client(f"http://127.0.0.1:{port}/", max_retries=1) as reward:
        with pytest.raises(RemoteRewardError, match=r"failed 2 tries .*last error: ConnectError"):
            reward.submit("r", "l", "p").result(timeout=30)


def test_closing_fails_what_waits_for_a_down_scorer_at_once(scorer_factory):
    scorer = scorer_factory(script=[503] * 100)
    reward = _client(scorer.url, batch_size=1, max_retries=5, backoff_s=10.0, num_connections=1)
    futures = [reward.submit("r", "l", f"p{i}") for i in range(6)]
    while not scorer.bodies:  # the first request was refused; its sender now backs off 10 s
        time.sleep(0.01)
    t0 = time.monotonic()
    reward.close()
    assert time.monotonic() - t0 < 5  # not 6 requests x (10 + 20 + ...) s of backoff
    with pytest.raises(RemoteRewardError, match=r"closed .* scored \(after _Retryable: HTTP 503"):
        futures[0].result(timeout=1)
    for future in futures[1:]:
        with pytest.raises(RemoteRewardError, match="closed before this request was scored$"):
            future.result(timeout=1)
    assert len(scorer.bodies) == 1


def test_replies_outside_the_schema_fail_at_once(scorer_factory):
    scorer = scorer_factory(script=[400])
    with _client(scorer.url) as reward:
        with pytest.raises(RemoteRewardError, match="answered HTTP 400: scorer overloaded"):
            reward.submit("r", "l", "p").result(timeout=30)
        assert reward.retries == 0
        scorer.reply_scores = [1.0, 2.0]
        with pytest.raises(RemoteRewardError, match="returned 2 scores for 1 items"):
            reward.submit("r", "l", "p").result(timeout=30)
        scorer.reply_scores = ["high"]
        with pytest.raises(RewardPluginError, match=r"prompt 'the prompt' is 'high' \(str\)"):
            reward.submit("r", "l", "the prompt").result(timeout=30)


def test_open_reward_reads_the_api_key_from_the_named_variable(scorer_factory, monkeypatch):
    scorer = scorer_factory()
    rollout = RolloutConfig(reward="http", reward_url=scorer.url, reward_api_key_env="RM_KEY_T")
    monkeypatch.delenv("RM_KEY_T", raising=False)
    with pytest.raises(ValueError, match="reward_api_key_env='RM_KEY_T': that environment"):
        open_reward(rollout)
    monkeypatch.setenv("RM_KEY_T", "k2")
    with open_reward(rollout) as reward:
        assert reward("abc", "l") == 3.0
    assert scorer.headers_seen[0]["Authorization"] == "Bearer k2"


def test_a_dripping_reply_is_cut_off_at_the_whole_request_deadline(scorer_factory):
    # ~45 bytes at 0.2 s each (9 s): every read is quick, the request is not. Before the
    # whole-request deadline this waited for all of it and succeeded after ~9 s per try.
    scorer = scorer_factory(script=["drip", "drip"])
    with _client(scorer.url, timeout_s=1.0, max_retries=1) as reward:
        t0 = time.monotonic()
        with pytest.raises(
            RemoteRewardError, match=r"failed 2 tries .*not complete within .*=1.0 s"
        ):
            reward.submit("r", "l", "p").result(timeout=30)
        assert time.monotonic() - t0 < 5  # 2 tries of ~1 s (+ slack for a loaded machine)
        assert reward.retries == 1


@pytest.mark.parametrize("status", [408, 501, 507, 524])
def test_408_and_every_5xx_are_retried_and_counted(scorer_factory, status):
    scorer = scorer_factory(script=[status, status])
    with _client(scorer.url) as reward:
        assert reward.submit("abc", "l", "p").result(timeout=30).score == 3.0
        assert reward.retries == 2
    assert len(scorer.bodies) == 3


def test_undecodable_and_out_of_range_replies_name_the_scorer(scorer_factory):
    bigint = b'{"scores": [' + b"9" * 400 + b"]}"
    scorer = scorer_factory(script=[b'{"scores": [1.0], "note": "\xff\xfe"}', bigint])
    with _client(scorer.url, batch_size=1) as reward:
        with pytest.raises(RemoteRewardError, match=r"scorer http://.*reply is not .*codec can't"):
            reward.submit("r", "l", "p").result(timeout=30)
        with pytest.raises(RewardPluginError, match=r"scorer http://.* prompt 'p9' is an int of "):
            reward.submit("r", "l", "p9").result(timeout=30)
        assert reward.retries == 0
