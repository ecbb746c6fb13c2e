"""Reward plug-ins (``rollout.reward=python``): loading by module or file, the errors a bad
plug-in gets before step 1, the example plug-in, and plug-ins run in the reward workers."""

from __future__ import annotations

import math
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_sat.config.run import RolloutConfig
from megatron_sat.rollout.reward_plugins import (
    RewardPluginError,
    RewardResult,
    check_finite_rewards,
    load_reward_function,
    reward_metrics,
    reward_result,
)
from megatron_sat.rollout.rewards import RewardWorkers
from megatron_sat.rollout.types import Sample

EXAMPLE = Path(__file__).parents[1] / "examples" / "rewards" / "length_penalized_math.py"
EXAMPLE_SPEC = f"{EXAMPLE}:length_penalized_math"


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import math

            def exact(prompt, response, label, metadata):
                return float(response.strip() == label) + metadata.get("bonus", 0.0)

            def three_args(prompt, response, label):
                return 1.0

            def keywords(*, prompt, response, label, metadata):
                return 1.0

            def flexible(*args, **kwargs):
                return 0.5

            def flexible_text(*args):
                return "1"

            def exits(prompt, response, label, metadata):
                raise SystemExit(3)

            not_callable = 3
            """
        )
    )
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_rewards", "broken", "exits"):
        sys.modules.pop(name, None)


def test_loads_module_function_and_file_function(plugin_dir):
    by_module = load_reward_function("my_rewards:exact")
    assert by_module("p", " 7 ", "7", {"bonus": 0.25}) == 1.25
    by_file = load_reward_function(f"{plugin_dir / 'my_rewards.py'}:exact")
    assert by_file("p", "8", "7", {}) == 0.0
    assert load_reward_function("my_rewards:flexible")("p", "r", "l", {}) == 0.5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_abc:f", r"cannot import no_such_module_abc \(ModuleNotFoundError"),
        ("broken:f", r"cannot import broken \(ModuleNotFoundError: No module named 'no_such_mod"),
        ("/nonexistent/r.py:f", r"cannot import /nonexistent/r.py \(FileNotFoundError"),
        ("my_rewards:missing", r"my_rewards has no attribute 'missing'"),
        ("my_rewards:not_callable", r"not_callable is not callable"),
        ("my_rewards:three_args", r"signature three_args\(prompt, response, label\); it is called"),
        ("my_rewards:keywords", r"signature keywords\(\*, prompt"),
        # sys.exit at import ended the trainer with rc 0 and no message
        ("exits:f", r"'exits:f': cannot import exits \(SystemExit: 0\)"),
    ],
)
def test_bad_plugins_get_a_clear_error(plugin_dir, spec, message):
    with pytest.raises(RewardPluginError, match=message):
        load_reward_function(spec)


def test_results_numbers_and_dicts_and_refusals():
    assert reward_result(1, "f", "p") == RewardResult(1.0, {})
    assert reward_result({"score": 0.5, "len": 3}, "f", "p") == RewardResult(0.5, {"len": 3.0})
    assert math.isnan(reward_result(float("nan"), "f", "p").score)  # refused later, by sample
    for bad, message in [
        ("1.0", r"for prompt 'What is 2\+2\?' is '1.0' \(str\), not a number"),
        (None, r"is None \(NoneType\)"),
        (True, r"is True \(bool\)"),
        ({"len": 3}, r"a dict without 'score': \['len'\]"),
        ({"score": 1.0, "note": "ok"}, r"entry 'note' is 'ok' \(str\)"),
        (10**400, r"for prompt 'What is 2\+2\?' is an int of 1329 bits, past float64's"),
        ({"score": 1.0, "n": -(10**400)}, r"entry 'n' is an int of 1329 bits"),
    ]:
        with pytest.raises(RewardPluginError, match=message):
            reward_result(bad, "f", "What is 2+2?")


def _sample(index: int, reward: float, metrics: dict | None = None) -> Sample:
    return Sample(
        index=index,
        group_index=0,
        prompt=f"prompt number {index}",
        label="1",
        prompt_ids=[1],
        response_ids=[2],
        rollout_log_probs=[0.0],
        response_versions=[0],
        reward=reward,
        reward_metrics=metrics or {},
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_reward_is_refused_naming_the_sample(bad):
    check_finite_rewards([_sample(3, 1.0), _sample(4, 0.0)])
    with pytest.raises(ValueError, match=rf"sample 8 has reward {bad} .*prompt 'prompt number 8'"):
        check_finite_rewards([_sample(7, 1.0), _sample(8, bad), _sample(9, bad)])


def test_a_reward_past_float32_is_refused_naming_the_sample():
    # finite in float64 but inf in the float32 advantages, where it was masked to 0 silently
    check_finite_rewards([_sample(1, 3.0e38), _sample(2, -3.0e38)])
    with pytest.raises(ValueError, match=r"sample 5 has reward 1e\+39, past float32's range"):
        check_finite_rewards([_sample(4, 1.0), _sample(5, 1e39)])


def test_reward_metrics_are_means_per_name():
    samples = [_sample(0, 1, {"a": 1.0, "b": 2.0}), _sample(1, 0, {"a": 0.0}), _sample(2, 0)]
    assert reward_metrics(samples) == {"reward/a": 0.5, "reward/b": 2.0}


def test_example_plugin_scores_correctness_with_its_length_penalty():
    function = load_reward_function(EXAMPLE_SPEC)
    right = "so \\boxed{82}"
    assert function("p", right, "82", {}) == {"score": 1.0, "correct": 1.0, "length_penalty": 0.0}
    # 10 characters of budget: 13 characters is 3 over, -0.5 * 3 / 10
    assert function("p", right, "82", {"length_budget": 10}) == pytest.approx(
        {"score": 0.85, "correct": 1.0, "length_penalty": -0.15}
    )
    # at twice the budget and beyond: the whole penalty
    assert function("p", "x" * 50 + "\\boxed{81}", "82", {"length_budget": 10}) == {
        "score": -0.5,
        "correct": 0.0,
        "length_penalty": -0.5,
    }


def test_rollout_config_names_the_reward_fields():
    assert RolloutConfig().reward == "math"
    with pytest.raises(ValueError, match="rollout.reward=python needs rollout.reward_function"):
        RolloutConfig(reward="python")
    with pytest.raises(ValueError, match="reward_url='http://x' is used only with rollout.rew"):
        RolloutConfig(reward_url="http://x")
    with pytest.raises(ValueError, match="must be 'module:function' or 'path.py:function'"):
        RolloutConfig(reward="python", reward_function="my_rewards.exact")
    with pytest.raises(ValueError, match="reward_timeout_s must be an int >= 1"):
        RolloutConfig(reward="python", reward_function="m:f", reward_timeout_s=0)
    # a setting the chosen reward ignores is refused when changed from its default
    for reward, extra, field in [
        ("math", {"reward_timeout_s": 600}, "reward_timeout_s=600"),
        ("math", {"reward_batch_size": 7}, "reward_batch_size=7"),
        ("python", {"reward_batch_size": 7}, "reward_batch_size=7"),
        ("python", {"reward_max_retries": 0}, "reward_max_retries=0"),
    ]:
        function = {"reward_function": "m:f"} if reward == "python" else {}
        with pytest.raises(ValueError, match=rf"rollout.{field} is used only with rollout.reward="):
            RolloutConfig(reward=reward, **function, **extra)
    RolloutConfig(reward="python", reward_function="m:f", reward_timeout_s=600)
    RolloutConfig(reward="http", reward_url="http://x", reward_batch_size=7, reward_max_retries=0)


def test_reward_workers_run_the_plugin_with_prompt_and_metadata_and_its_timeout(plugin_dir):
    (plugin_dir / "slow.py").write_text(
        "import time\n\ndef slow(prompt, response, label, metadata):\n"
        "    time.sleep(float(response))\n    return {'score': 1.0, 'slept': float(response)}\n"
    )
    with pytest.raises(RewardPluginError, match="cannot import broken"):
        RewardWorkers(num_workers=1, function="broken:f")  # before any worker starts
    with RewardWorkers(num_workers=1, timeout_s=2, function=f"{plugin_dir}/slow.py:slow") as w:
        assert w.submit("0", "x", "p", {}).result() == RewardResult(1.0, {"slept": 0.0})
        with pytest.raises(TimeoutError, match=r"more than 2 s .*for prompt 'the slow one'"):
            w.submit("30", "x", "the slow one", {}).result(timeout=60)
        assert w.submit("0.1", "x", "p", {}).result().metrics == {"slept": 0.1}
    with RewardWorkers(num_workers=1, function="my_rewards:exact") as w:
        assert w.submit("7", "7", "p", {"bonus": 0.5}).result() == RewardResult(1.5, {})
        assert w("7", "7") == 1.0  # called like math_reward: the score
        with pytest.raises(RewardPluginError, match=r"raised TypeError: .* for prompt 'p2'"):
            w.submit("7", "7", "p2", {"bonus": "x"}).result()
    with RewardWorkers(num_workers=1, function="my_rewards:flexible_text") as w:
        with pytest.raises(RewardPluginError, match=r"for prompt 'p3' is '1' \(str\)"):
            w.submit("7", "7", "p3", {}).result()
    with RewardWorkers(num_workers=1, function="my_rewards:exits") as w:  # not a SystemExit here
        with pytest.raises(RewardPluginError, match=r"raised SystemExit: 3 for prompt 'p4'"):
            w.submit("7", "7", "p4", {}).result()


def test_submit_reward_passes_prompt_and_metadata_to_a_submitting_reward(plugin_dir):
    from concurrent.futures import ThreadPoolExecutor

    from megatron_sat.rollout.datasets import PromptRecord
    from megatron_sat.rollout.pool import submit_reward

    with ThreadPoolExecutor(1) as threads, RewardWorkers(1, function="my_rewards:exact") as w:
        record = PromptRecord("p", "7", 0, {"bonus": 0.25})
        assert submit_reward(w, threads, "7", record).result() == RewardResult(1.25, {})
        plain = PromptRecord("p", "7", 0)  # a row without metadata: {}
        assert submit_reward(w, threads, "7", plain).result() == RewardResult(1.0, {})
        # a plain callable gets (response, label) on the threads, as before
        assert submit_reward(lambda r, label: float(r == label), threads, "7", plain).result() == 1


HANGS = """
import time

def alarm_cancelled(prompt, response, label, metadata):
    from math_verify import parse, verify

    ok = verify(parse("\\\\boxed{1}"), parse(response))  # sets and resets signal.alarm itself
    time.sleep(float(label))
    return float(ok)

def swallows(prompt, response, label, metadata):
    end = time.monotonic() + float(label)
    while time.monotonic() < end:
        try:
            time.sleep(0.1)
        except Exception:
            pass
    return 0.0

def swallows_once(prompt, response, label, metadata):
    try:
        time.sleep(float(label))
    except Exception:
        pass
    return 0.0
"""


@pytest.mark.parametrize("name", ["alarm_cancelled", "swallows", "swallows_once"])
def test_a_plugin_that_defeats_the_alarm_still_times_out_and_close_does_not_hang(tmp_path, name):
    # Before the parent's deadline: alarm_cancelled slept its 30 s and scored 1.0; swallows
    # caught the alarm's TimeoutError and scored 0.0 after 30 s; swallows_once scored 0.0 at
    # once (the worker's alarm caught, no error).
    (tmp_path / "hangs.py").write_text(HANGS)
    w = RewardWorkers(num_workers=1, timeout_s=1, function=f"{tmp_path}/hangs.py:{name}")
    try:
        t0 = time.monotonic()
        slow = w.submit("\\boxed{1}", "30", "the hung one", {})
        queued = w.submit("\\boxed{1}", "0", "queued behind it", {})
        with pytest.raises(TimeoutError, match=r"more than 1 s .*for prompt 'the hung one'"):
            slow.result(timeout=60)
        assert time.monotonic() - t0 < 1 + w.DEADLINE_SLACK_S + 5  # not 30 s
        # the call queued behind it was not charged for its wait: scored on the new pool
        assert queued.result(timeout=60).score == (1.0 if name == "alarm_cancelled" else 0.0)
        assert w.restarts == (0 if name == "swallows_once" else 1)
        w.submit("\\boxed{1}", "30", "hung at close", {})
    finally:
        t0 = time.monotonic()
        w.close()
    assert time.monotonic() - t0 < 1 + w.DEADLINE_SLACK_S + 5
