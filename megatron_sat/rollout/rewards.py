"""Verifiable math rewards: the last ``\\boxed{...}`` of a response against the label.

Equality is math-verify's (``math_verify.parse`` / ``verify``, version 0.9.0): "82", "82.0" and
"\\frac{164}{2}" all match the label "82".

Threads: math-verify bounds its work with ``signal.alarm``, which Python allows only in the main
thread; with its default timeouts, ``parse`` and ``verify`` raise ``ValueError`` ("doesn't
support threaded environment") when called from any other thread, e.g. the rollout pool's
asyncio thread. `math_reward` therefore runs math-verify without timeouts by default
(``timeout_s=None``), which works in every thread. The price: sympy work is then unbounded, and
an adversarial answer such as ``\\boxed{10^{10^{10^{10}}}}`` compared with "82" did not finish in
two minutes. Where that matters, run rewards in worker processes (a ``ProcessPoolExecutor`` runs
tasks in its workers' main threads) and pass ``timeout_s``: `RewardWorkers` does that, and is
what the RL loop uses (rewards scored concurrently, each bounded by math-verify's own timeouts).

math-verify logs one warning per process ("Timeout is disabled ...") the first time it runs
without timeouts; it is expected.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from math_verify import parse, verify
from sympy import Basic

from megatron_sat.rollout.reward_plugins import (
    RewardPluginError,
    RewardResult,
    as_reward_result,
    load_reward_function,
    resolve_spec,
    reward_result,
)

BOXED_PREFIX = "\\boxed{"
# Parsed labels kept per process (``parse_label``): a label is parsed once per group of
# ``group_size`` samples at most, and an arithmetic or math dataset repeats labels.
LABEL_CACHE_SIZE = 4096


def last_boxed_content(response: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in `response`, braces balanced.

    Args:
        response: Generated text.

    Returns:
        The text between the braces of the last ``\\boxed{`` (nested braces kept, e.g.
        "\\frac{1}{2}"), or None when there is no ``\\boxed{`` or the last one is never closed.
        A final unclosed box counts as no answer even when an earlier box is closed: the last
        answer the model started is the one it gives.
    """
    start = response.rfind(BOXED_PREFIX)
    if start < 0:
        return None
    depth = 1
    content_start = start + len(BOXED_PREFIX)
    for position in range(content_start, len(response)):
        char = response[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return response[content_start:position]
    return None


def _check_timeout(timeout_s: int | None) -> None:
    """Rejects timeouts math-verify cannot honour here, before it fails deep inside."""
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
        # signal.alarm takes whole seconds; math-verify treats <= 0 as "no timeout".
        raise ValueError(f"timeout_s must be None or an int >= 1 (seconds), got {timeout_s!r}")
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            f"timeout_s={timeout_s} needs the main thread (math-verify uses signal.alarm); "
            f"called from thread {threading.current_thread().name!r}: pass timeout_s=None"
        )


def parse_label(label: str, *, timeout_s: int | None = None) -> list:
    """Parses a ground-truth label with math-verify.

    Args:
        label: Answer text ("82", "-8", "\\frac{1}{2}"), with or without ``\\boxed{}``.
        timeout_s: Per-expression timeout in whole seconds (main thread only), or None.

    Returns:
        math-verify's parse result (sympy objects and strings), non-empty; a new list per call
        over a per-process memo of the last ``LABEL_CACHE_SIZE`` labels.

    Raises:
        ValueError: `label` is empty or math-verify extracts nothing from it (a data error, not a
            wrong answer), or `timeout_s` is invalid here; raised on every call, never cached.
    """
    _check_timeout(timeout_s)
    # sympy expressions and str are immutable; anything else (a pmatrix label parses to a
    # MutableDenseMatrix) is copied, so that no caller can edit the memo's value.
    return [
        g if isinstance(g, (Basic, str)) else copy.deepcopy(g)
        for g in _parse_label_cached(label, timeout_s)
    ]


@functools.lru_cache(maxsize=LABEL_CACHE_SIZE)
def _parse_label_cached(label: str, timeout_s: int | None) -> tuple:
    """`parse_label`'s parse, memoised per process: all ``group_size`` samples of a prompt
    share its label, and the label's parse was over 95% of `math_reward`'s cost (2-digit
    arithmetic labels, 2-core CPU, load 3: 0.8-1.2 ms of Python per reward without the memo,
    1-55 us with it), Python that the async pool's reward threads run under the trainer's GIL
    (bench/async_throughput.py) or a reward worker beside the trainer. Its values are never
    handed out as they are: `parse_label` copies the mutable ones. Errors are raised, never
    cached."""
    if not label.strip():
        raise ValueError("label is empty")
    # Wrapping in \boxed{} puts the gold answer through the same extraction path as the answer.
    text = label if BOXED_PREFIX in label else f"{BOXED_PREFIX}{label}}}"
    gold = parse(text, parsing_timeout=timeout_s, raise_on_error=True)
    if not gold:
        raise ValueError(f"math-verify cannot parse the label {label!r}")
    return tuple(gold)


def math_reward(response: str, label: str, *, timeout_s: int | None = None) -> float:
    """1.0 when the last ``\\boxed{...}`` of `response` equals `label` per math-verify, else 0.0.

    Args:
        response: Generated text; only its last ``\\boxed{...}`` is graded (see
            `last_boxed_content`); no box, an unclosed last box or an empty box give 0.0.
        label: Ground-truth answer, parsed by `parse_label`.
        timeout_s: None (default): no timeouts, callable from any thread, unbounded time on
            pathological answers. An int >= 1: math-verify's per-expression timeout in seconds,
            main thread only; a timed-out comparison gives 0.0.

    Returns:
        1.0 or 0.0.

    Raises:
        ValueError: The label cannot be parsed, or `timeout_s` is set off the main thread or is
            not a positive int.
    """
    gold = parse_label(label, timeout_s=timeout_s)
    content = last_boxed_content(response)
    if content is None or not content.strip():
        return 0.0
    # raise_on_error=False: model output that sympy cannot read is a wrong answer, not a crash.
    answer = parse(f"{BOXED_PREFIX}{content}}}", parsing_timeout=timeout_s)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout_s) else 0.0


def batch_rewards(
    responses: Sequence[str], labels: Sequence[str], *, timeout_s: int | None = None
) -> list[float]:
    """`math_reward` of each (response, label) pair, in order.

    Raises:
        ValueError: `responses` and `labels` differ in length, or as `math_reward`.
    """
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    return [
        math_reward(response, label, timeout_s=timeout_s)
        for response, label in zip(responses, labels, strict=True)
    ]


class RewardWorkers:
    """`math_reward` (or a reward plug-in) scored concurrently in worker processes, with
    timeouts on.

    Each worker process runs its tasks in its main thread, where math-verify's
    ``signal.alarm`` timeouts work, so an answer whose sympy comparison does not end within
    ``timeout_s`` scores 0.0 instead of blocking the rollout. Workers are started with
    ``spawn`` (the trainer process has threads; a forked child could inherit a held lock)
    and end with this process, also when it is SIGKILLed (without that a killed trainer
    left them running, seen here).

    With ``function`` (``rollout.reward=python``), each worker imports that plug-in
    (``rollout.reward_plugins``) instead, and every call is bounded by ``timeout_s`` as a whole;
    a call past it raises ``TimeoutError`` naming the prompt. Two bounds: ``signal.alarm`` in the
    worker (cheap, the worker lives on), and a deadline ``DEADLINE_SLACK_S`` later kept by this
    process, which kills the pool's workers and replaces the pool. The second is what holds: a
    plug-in may cancel the alarm (math-verify's ``parse`` / ``verify`` set and reset
    ``signal.alarm`` themselves) or swallow the ``TimeoutError`` in an ``except Exception``. So
    that the deadline counts from a call's start, at most ``num_workers`` plug-in calls are in
    the pool at once (the rest wait here). The plug-in is also loaded and checked here first,
    so a bad one fails before any worker starts.

    Args:
        num_workers: worker processes (>= 1).
        timeout_s: math-verify's per-expression timeout, or a plug-in call's, whole seconds (>= 1).
        function: a plug-in spec (``module:function`` or ``path.py:function``), or None for
            `math_reward`.

    Raises:
        ValueError: for a count or timeout < 1.
        RewardPluginError: for a plug-in that cannot be imported or has the wrong signature.

    Use as ``reward_fn`` of the rollout pools (it is callable like `math_reward`; the pools
    call ``submit`` to overlap scoring with generation), and ``close`` it at the end.
    """

    MAX_TRIES = 3  # scorings of one pair before a dying worker's error is raised
    retries = 0  # no requests to send again (RemoteReward's counter, logged per step)
    DEADLINE_SLACK_S = 2.0  # the parent's deadline past the worker's alarm, seconds

    def __init__(
        self, num_workers: int = 2, timeout_s: int = 5, function: str | None = None
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(f"timeout_s must be an int >= 1 (seconds), got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.function = None
        if function is not None:
            load_reward_function(function)  # its errors here, not as a broken pool
            self.function = resolve_spec(function)
        self.restarts = 0  # pools replaced after a worker died (e.g. the OOM killer)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a plug-in call ends
        self._waiting: deque = deque()  # plug-in calls not yet in the pool: (out, task, tries)
        self._in_pool = 0  # plug-in calls in the pool
        self._executor = self._new_executor()
        # Start the workers now (they import math-verify), not at the first reward.
        for warm in [self._executor.submit(int, 0) for _ in range(num_workers)]:
            warm.result()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.num_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_end_with_parent,
            initargs=(os.getpid(), self.function),
        )

    def submit(
        self, response: str, label: str, prompt: str = "", metadata: dict | None = None
    ) -> Future:
        """Start scoring one pair; the future resolves to `math_reward`'s 1.0 or 0.0 (or
        raises its ValueError for an unparseable label), or to the plug-in's `RewardResult`
        (``prompt`` and ``metadata`` are passed to the plug-in only).

        A worker that dies (SIGKILL, OOM) breaks a ``ProcessPoolExecutor`` for good, failing
        every pending task: the pool is then replaced and the pair scored again, up to
        ``MAX_TRIES`` times (the score is a pure function of the pair), then the error is
        raised."""
        out: Future = Future()
        task = (response, label, self.timeout_s)
        if self.function is not None:
            task = (response, label, self.timeout_s, prompt, metadata or {}, self.function)
        self._submit_into(out, task, tries=1)
        return out

    def _submit_into(self, out: Future, task: tuple, tries: int) -> None:
        plugin = len(task) > 3
        with self._lock:
            if plugin and self._in_pool >= self.num_workers:
                self._waiting.append((out, task, tries))
                return
            self._in_pool += plugin
            executor = self._executor
        job = _plugin_reward if plugin else _timed_reward
        try:
            inner = executor.submit(job, *task)
        except BrokenProcessPool as e:
            self._leave_pool(plugin)
            self._retry(out, task, tries, executor, e)
            return
        except BaseException:  # e.g. submitted after close(): keep the count close() waits on
            self._leave_pool(plugin)
            raise
        timer = None
        if plugin:
            timer = threading.Timer(
                self.timeout_s + self.DEADLINE_SLACK_S, self._expire, (out, inner, executor, task)
            )
            timer.daemon = True
            timer.start()

        def done(f: Future) -> None:
            if timer is not None:
                timer.cancel()
            self._leave_pool(plugin)
            if out.done():  # timed out already: the parent's deadline answered it
                return
            error = f.exception()
            if isinstance(error, BrokenProcessPool):
                self._retry(out, task, tries, executor, error)
            elif error is not None:
                out.set_exception(error)
            else:
                out.set_result(f.result())

        inner.add_done_callback(done)

    def _leave_pool(self, plugin: bool) -> None:
        """A plug-in call left the pool: start the next waiting one."""
        if not plugin:
            return
        with self._lock:
            self._in_pool -= 1
            following = self._waiting.popleft() if self._waiting else None
            self._idle.notify_all()
        if following is not None:
            self._submit_into(*following)

    def _expire(self, out: Future, inner: Future, executor: ProcessPoolExecutor, task) -> None:
        """The parent's deadline of one plug-in call: fail it with ``TimeoutError`` and kill
        the pool's workers (the one running it cannot be told apart; the others' calls are
        scored again on the replacement pool, as after any worker death)."""
        if inner.done():
            return
        prompt, function = task[3], task[5]
        try:
            out.set_exception(
                TimeoutError(
                    f"reward function {function!r} took more than {self.timeout_s} s "
                    f"(rollout.reward_timeout_s; not ended by its alarm within "
                    f"{self.DEADLINE_SLACK_S} s more: workers killed) for prompt {prompt[:60]!r}"
                )
            )
        except InvalidStateError:  # answered meanwhile
            return
        for process in list((executor._processes or {}).values()):  # no public handle
            process.kill()

    def _retry(self, out, task, tries, broken, error) -> None:
        if out.done():
            return
        if tries >= self.MAX_TRIES:
            out.set_exception(error)
            return
        with self._lock:
            if self._executor is broken:  # the first task to see it replaces the pool
                self._executor = self._new_executor()
                self.restarts += 1
                broken.shutdown(wait=False)
                print(
                    f"reward workers: a worker died ({error}); replaced the pool "
                    f"(replacement {self.restarts}), scoring its pairs again",
                    file=sys.stderr,
                    flush=True,
                )
        self._submit_into(out, task, tries + 1)

    def __call__(self, response: str, label: str) -> float:
        """The reward of one pair, waited for (a plug-in's score, without its metrics)."""
        return as_reward_result(self.submit(response, label).result()).score

    def close(self) -> None:
        """Stop the worker processes, after the tasks already submitted (each plug-in call
        ends within its deadline, so this does not wait forever on a hung one)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._in_pool and not self._waiting)
            executor = self._executor
        executor.shutdown(wait=True)

    def __enter__(self) -> RewardWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _end_with_parent(parent_pid: int, function: str | None = None, poll_s: float = 1.0) -> None:
    """Worker initializer: exit once the parent is gone (PR_SET_PDEATHSIG alone did not do it
    here: it follows the parent *thread*, and one of two workers outlived a SIGKILLed parent,
    so a daemon thread polls the parent pid), and warm math-verify up (or import the reward
    plug-in ``function`` instead). First the thread
    policy (``platform.threads``): one thread each, unless the user set ``OMP_NUM_THREADS``."""
    from megatron_sat.platform.threads import configure_threads

    configure_threads(threads=1)
    # Ctrl-C reaches the whole foreground process group and SIGUSR1 a job's processes: both
    # ask the trainer to stop after its step (training.stop), which then ends these workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    # math-verify imports its grammars on first use, inside the first call's timeout: on a
    # loaded machine parsing the label "82" then timed out (seen at 1 s) and raised. Warm up
    # here, without timeouts, so the timeouts bound only the comparisons.
    if function is not None:
        load_reward_function(function)  # imported once per worker, here
        return
    math_reward("\\boxed{1}", "1")


def _timed_reward(response: str, label: str, timeout_s: int) -> float:
    """`math_reward` with timeouts, run in a worker process's main thread."""
    return math_reward(response, label, timeout_s=timeout_s)


def _plugin_reward(
    response: str, label: str, timeout_s: int, prompt: str, metadata: dict, function: str
) -> RewardResult:
    """The plug-in ``function``'s reward (loaded once per worker, by ``_end_with_parent``),
    bounded by ``timeout_s`` with ``signal.alarm`` (a worker process's main thread).

    Raises:
        TimeoutError: naming the prompt, for a call past ``timeout_s``.
        RewardPluginError: for a result that is not a number or a dict with a ``score``, or
            any error the plug-in raised (its type and message kept, the prompt named).
    """

    fired = []

    def expire(signum, frame):
        fired.append(True)
        raise TimeoutError(
            f"reward function {function!r} took more than {timeout_s} s "
            f"(rollout.reward_timeout_s) for prompt {prompt[:60]!r}"
        )

    reward_fn = load_reward_function(function)  # cached in sys.modules after the first
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout_s)
    try:
        output = reward_fn(prompt, response, label, metadata)
    except TimeoutError:
        raise
    # SystemExit / KeyboardInterrupt too: sent back raw, they would end the trainer as if asked
    # to (sys.exit in a plug-in is a bug of the plug-in, not a request to stop the run).
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        # the worker's traceback does not cross the process boundary
        raise RewardPluginError(
            f"reward function {function!r} raised {type(e).__name__}: {e} "
            f"for prompt {prompt[:60]!r}"
        ) from e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if fired:  # the plug-in caught our TimeoutError (``except Exception``) and went on
        raise TimeoutError(
            f"reward function {function!r} took more than {timeout_s} s "
            f"(rollout.reward_timeout_s) for prompt {prompt[:60]!r} (it caught the timeout)"
        )
    return reward_result(output, function, prompt)
