"""A remote reward scorer over HTTP (``rollout.reward=http``): batching, timeouts, retries.

The scorer is any HTTP service (a learned reward model, a code sandbox, a verifier) that
answers the schema below, modelled on OpenRLHF's ``--remote_rm_url`` (a JSON POST of a batch,
answered by one reward per sample in order) with named fields per item and metrics per score.

Request: ``POST <rollout.reward_url>``, ``Content-Type: application/json``, and
``Authorization: Bearer <key>`` when ``rollout.reward_api_key_env`` names an environment
variable holding a key::

    {"items": [{"prompt": "...", "response": "...", "label": "...", "metadata": {...}}, ...]}

- ``prompt``: the prompt text as fed to the tokenizer (chat template applied);
- ``response``: the generated text, special tokens removed;
- ``label``: the dataset's ground truth; ``metadata``: the sample's JSON metadata (``{}`` when
  the dataset has none). At most ``rollout.reward_batch_size`` items per request.

Reply: HTTP 200 with ``{"scores": [...]}``, one entry per item, in order: a number, or an
object ``{"score": <number>, "<metric>": <number>, ...}`` whose other entries are logged as
``reward/<metric>`` (the step's mean), as a ``rollout.reward_plugins`` function's dict is.

Failures: a connection error, a timeout (``rollout.reward_timeout_s`` for the whole request,
connect to the reply's last byte: a scorer that drips its reply is cut off too), HTTP 408, 429 or
any 5xx is retried up to ``rollout.reward_max_retries`` times, waiting 1, 2, 4, ... s (at most 30 s)
between tries; then every sample of the request fails with `RemoteRewardError` naming the scorer
and the last error, which ends the run (the run checkpoint of the last saved step is untouched:
the failing step trained nothing). Any other HTTP status and a malformed reply (not UTF-8 JSON,
no ``scores``, a wrong count, a non-numeric score or one past float64's range) fail at once:
retrying would not change them. Retries are counted (``RemoteReward.retries``, logged per step as
``rollout/reward_retries``).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from megatron_sat.rollout.reward_plugins import RewardResult, reward_result


def is_retryable(status: int) -> bool:
    """HTTP 408 (request timeout), 429 (rate limited) and every 5xx: the scorer may answer the
    same request later; other statuses would not change on a retry."""
    return status in (408, 429) or 500 <= status <= 599


class RemoteRewardError(RuntimeError):
    """The remote scorer failed for good (down past its retries, or a malformed reply)."""


class _Retryable(Exception):
    """A reply worth sending the request again for (HTTP 408, 429, 5xx), or a request past its
    whole-request deadline."""


class RemoteReward:
    """Scores samples on a remote scorer; usable as the rollout pools' ``reward_fn``.

    ``submit`` queues one sample; a batcher thread sends up to ``batch_size`` queued samples
    per request (waiting at most ``max_wait_s`` for a batch to fill), ``num_connections``
    requests at a time. Retries and timeouts live here only.

    Args:
        url: the scorer's URL (``rollout.reward_url``).
        batch_size: items per request, >= 1.
        timeout_s: limit of one whole request (connect, send, wait, read every byte), seconds.
        max_retries: further tries of a failed request, >= 0.
        api_key: sent as ``Authorization: Bearer``; None sends none.
        backoff_s, max_backoff_s: the first wait between tries and its cap, seconds (doubled
            per try).
        max_wait_s: how long a batch waits for more samples, seconds.
        num_connections: requests in flight at once.
    """

    restarts = 0  # no worker processes to replace (RewardWorkers' counter, logged per step)

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 64,
        timeout_s: float = 30.0,
        max_retries: int = 5,
        api_key: str | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_wait_s: float = 0.05,
        num_connections: int = 4,
    ) -> None:
        if batch_size < 1 or max_retries < 0 or not timeout_s > 0:
            raise ValueError(
                f"batch_size >= 1, max_retries >= 0 and timeout_s > 0 needed, got "
                f"{batch_size}, {max_retries}, {timeout_s}"
            )
        self.url, self.batch_size, self.max_retries = url, batch_size, max_retries
        self.backoff_s, self.max_backoff_s, self.max_wait_s = backoff_s, max_backoff_s, max_wait_s
        self.retries = 0  # requests sent again, cumulative
        self.timeout_s = timeout_s
        self._closed = threading.Event()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout_s, headers=headers)
        self._queue: queue.Queue = queue.Queue()
        self._senders = ThreadPoolExecutor(num_connections, thread_name_prefix="remote-reward")
        self._batcher = threading.Thread(
            target=self._batch_loop, name="reward-batcher", daemon=True
        )
        self._batcher.start()

    def submit(
        self, response: str, label: str, prompt: str = "", metadata: dict | None = None
    ) -> Future:
        """Queue one sample; the future resolves to its `RewardResult` or raises
        `RemoteRewardError`."""
        out: Future = Future()
        item = {"prompt": prompt, "response": response, "label": label, "metadata": metadata or {}}
        self._queue.put((item, out))
        return out

    def __call__(self, response: str, label: str) -> float:
        return self.submit(response, label).result().score

    def _batch_loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.batch_size:
                try:
                    entry = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if entry is None:
                    self._queue.put(None)  # seen again by the outer loop, after this batch
                    break
                batch.append(entry)
            self._senders.submit(self._send, batch)

    def _send(self, batch: list[tuple[dict, Future]]) -> None:
        items = [item for item, _ in batch]
        try:
            results = self.score(items)
        except Exception as e:  # every sample of the request fails with it
            for _, out in batch:
                out.set_exception(e)
            return
        for (_, out), result in zip(batch, results, strict=True):
            out.set_result(result)

    def score(self, items: list[dict]) -> list[RewardResult]:
        """One request for ``items`` (the schema's item dicts), with retries.

        Raises:
            RemoteRewardError: past the retries, or for a reply outside the schema.
        """
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                # closing cuts the wait short: the run is ending, e.g. on another request's error
                self._closed.wait(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            if self._closed.is_set():
                after = "" if last is None else f" (after {type(last).__name__}: {last})"
                raise RemoteRewardError(
                    f"reward scorer {self.url}: closed before this request was scored{after}"
                )
            try:
                reply = self._post(items)
                if is_retryable(reply.status_code):
                    raise _Retryable(f"HTTP {reply.status_code}: {reply.text[:200]}")
            except (httpx.TransportError, _Retryable) as e:
                last = e
                print(
                    f"remote reward: {self.url} try {attempt + 1}/{self.max_retries + 1} "
                    f"failed ({type(e).__name__}: {e})",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            return self._parse(reply, items)
        raise RemoteRewardError(
            f"reward scorer {self.url} failed {self.max_retries + 1} tries "
            f"(rollout.reward_max_retries={self.max_retries}); last error: "
            f"{type(last).__name__}: {last}"
        )

    def _post(self, items: list[dict]) -> httpx.Response:
        """One POST, read in full within ``timeout_s`` from its start.

        httpx's timeouts bound each connect / write / read on its own, so a scorer sending one
        byte per second would never time out; the body is streamed and the deadline checked
        between chunks (each read is also bounded by ``timeout_s``, so a request ends within
        about twice it).

        Raises:
            _Retryable: past the deadline. httpx.TransportError: as httpx.
        """
        deadline = time.monotonic() + self.timeout_s
        timeout = httpx.Timeout(self.timeout_s)
        with self._client.stream("POST", self.url, json={"items": items}, timeout=timeout) as r:
            chunks = []
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise _Retryable(
                        f"reply not complete within rollout.reward_timeout_s={self.timeout_s} s "
                        f"({sum(map(len, chunks))} bytes read)"
                    )
            # the body is decoded already (gzip etc.): keep only the header naming its charset
            headers = {"content-type": r.headers.get("content-type", "application/json")}
            return httpx.Response(r.status_code, headers=headers, content=b"".join(chunks))

    def _parse(self, reply: httpx.Response, items: list[dict]) -> list[RewardResult]:
        if reply.status_code != 200:
            raise RemoteRewardError(
                f"reward scorer {self.url} answered HTTP {reply.status_code}: {reply.text[:200]}"
            )
        try:
            scores = reply.json()["scores"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise RemoteRewardError(
                f'reward scorer {self.url}: reply is not {{"scores": [...]}} ({e}): '
                f"{reply.text[:200]}"
            ) from e
        if not isinstance(scores, list) or len(scores) != len(items):
            count = len(scores) if isinstance(scores, list) else type(scores).__name__
            raise RemoteRewardError(
                f"reward scorer {self.url} returned {count} scores for {len(items)} items"
            )
        return [
            reward_result(score, f"scorer {self.url}", item["prompt"])
            for score, item in zip(scores, items, strict=True)
        ]

    def close(self) -> None:
        """Stop the batcher, the senders and the connections. Samples still queued or waiting
        for a retry fail with `RemoteRewardError` at once (a run that ends on a scorer's error
        does not wait out every other request's retries); a request in flight ends within its
        timeout."""
        self._closed.set()
        self._queue.put(None)
        self._batcher.join()
        self._senders.shutdown(wait=True)
        self._client.close()

    def __enter__(self) -> RemoteReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
