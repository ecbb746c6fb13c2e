"""User reward functions (``rollout.reward=python``): loading, checking and their results.

A plug-in is named ``package.module:function`` (imported from ``sys.path``) or
``path/to/file.py:function`` (loaded from that file), as verl's ``custom_reward_function.path`` +
``name`` and slime's ``--custom-rm-path`` name theirs. It is called once per sample as::

    function(prompt: str, response: str, label: str, metadata: dict) -> float | dict

- ``prompt``: the prompt text as fed to the tokenizer (chat template applied);
- ``response``: the generated text, special tokens removed;
- ``label``: the dataset's ground truth;
- ``metadata``: the sample's JSON metadata (verl's ``data_source`` / ``extra_info``, slime's
  ``--metadata-key``), ``{}`` when the dataset has none.

It returns the reward as a number, or a dict with the reward under ``score`` and any other
numeric entries as metrics (logged per step as ``reward/<name>``, the mean over the step's
samples). ``bool`` is refused (a ``True`` reward is more often a bug than a 1.0).

Errors are raised before the first step where they can be: `load_reward_function` refuses a
missing module or file, a missing or non-callable attribute and a signature that cannot take the
four arguments positionally; `reward_result` refuses a result that is not a number or such a
dict; the run refuses a non-finite score before it trains on it (``check_finite_rewards``),
naming the sample.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ARGUMENTS = ("prompt", "response", "label", "metadata")
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max; torch not imported here


class RewardPluginError(ValueError):
    """A reward plug-in cannot be loaded or returned something unusable; the message names it."""


@dataclass(frozen=True)
class RewardResult:
    """One sample's reward: the score trained on and the plug-in's extra metrics.

    Attributes:
        score: the reward (may be non-finite here; the run refuses it, naming the sample).
        metrics: extra numeric metrics by name (e.g. ``{"length_penalty": -0.1}``).
    """

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


def resolve_spec(spec: str) -> str:
    """``spec`` with a file path made absolute (the reward workers may resolve it elsewhere).

    Raises:
        RewardPluginError: for a spec without ``:function``.
    """
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise RewardPluginError(
            f"reward function {spec!r} must be 'module:function' or 'path.py:function'"
        )
    if target.endswith(".py"):
        return f"{Path(target).resolve()}:{name}"
    return spec


def check_plugin_file(spec: str) -> None:
    """Without importing anything: the file of a ``path.py:function`` spec exists (a module
    spec is not checked here; ``load_reward_function`` imports it).

    Raises:
        FileNotFoundError: naming the spec and the resolved path.
        RewardPluginError: for a spec without ``:function``.
    """
    target = resolve_spec(spec).rpartition(":")[0]
    if target.endswith(".py") and not Path(target).is_file():
        raise FileNotFoundError(f"rollout.reward_function={spec!r}: no file {target}")


def load_reward_function(spec: str) -> Callable[[str, str, str, dict], object]:
    """Imports and checks the plug-in ``spec`` (``module:function`` or ``path.py:function``).

    Returns:
        The function.

    Raises:
        RewardPluginError: the module or file cannot be imported (its error chained), the
            attribute is missing or not callable, or its signature cannot take
            (prompt, response, label, metadata) positionally.
    """
    target, _, name = resolve_spec(spec).rpartition(":")
    module = _import(target, spec)
    function = getattr(module, name, None)
    if function is None:
        raise RewardPluginError(f"reward function {spec!r}: {target} has no attribute {name!r}")
    if not callable(function):
        raise RewardPluginError(f"reward function {spec!r}: {name} is not callable")
    try:
        inspect.signature(function).bind(*ARGUMENTS)
    except TypeError as e:
        raise RewardPluginError(
            f"reward function {spec!r} has signature {name}{inspect.signature(function)}; it is "
            f"called as {name}({', '.join(ARGUMENTS)}) ({e})"
        ) from e
    except ValueError:  # builtins without a signature: trust them
        pass
    return function


def _import(target: str, spec: str):
    try:
        if not target.endswith(".py"):
            return importlib.import_module(target)
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        # A name of its own per file, so two plug-ins named reward.py do not collide.
        module_name = f"megatron_sat_reward_plugin_{abs(hash(str(path)))}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    except (Exception, SystemExit) as e:  # sys.exit() at import would end the trainer, rc 0
        raise RewardPluginError(
            f"reward function {spec!r}: cannot import {target} ({type(e).__name__}: {e})"
        ) from e


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardPluginError(f"{what} is {value!r} ({type(value).__name__}), not a number")
    try:
        return float(value)
    except OverflowError as e:  # an int past float64's range, e.g. 10**400
        bits = int(value).bit_length()
        raise RewardPluginError(f"{what} is an int of {bits} bits, past float64's range") from e


def reward_result(output: object, source: str, prompt: str) -> RewardResult:
    """A plug-in's (or remote scorer's) return value as a `RewardResult`.

    Args:
        output: a real number, or a dict with a numeric ``score`` and other numeric entries.
        source: the plug-in or scorer, for errors.
        prompt: the sample's prompt, whose head errors name.

    Raises:
        RewardPluginError: for anything else (``bool``, ``str``, ``None``, a dict without
            ``score`` or with a non-numeric or non-string-keyed entry).
    """
    where = f"reward from {source} for prompt {prompt[:60]!r}"
    if isinstance(output, dict):
        if "score" not in output:
            raise RewardPluginError(f"{where} is a dict without 'score': {sorted(output)}")
        metrics = {}
        for key, value in output.items():
            if not isinstance(key, str):
                raise RewardPluginError(f"{where} has a non-string key {key!r}")
            metrics[key] = _number(value, f"{where}: entry {key!r}")
        score = metrics.pop("score")
        return RewardResult(score, metrics)
    return RewardResult(_number(output, where))


def as_reward_result(reward: float | RewardResult) -> RewardResult:
    """A reward function's result as a `RewardResult` (a float has no extra metrics)."""
    if isinstance(reward, RewardResult):
        return reward
    return RewardResult(float(reward))


def check_finite_rewards(samples) -> None:
    """Refuses a batch with a non-finite reward, before anything is trained on it.

    Args:
        samples: ``rollout.types.Sample``s with their rewards set.

    Raises:
        ValueError: naming the first such sample (index, reward, prompt head); also for a
            finite reward past float32's range (it would become inf in the float32 advantages
            and be masked to advantage 0 silently).
    """
    for s in samples:
        if not math.isfinite(s.reward):
            raise ValueError(
                f"sample {s.index} has reward {s.reward} (not finite): refused before the "
                f"optimizer step; prompt {s.prompt[:80]!r}, response {s.response_text[:80]!r}"
            )
        if abs(s.reward) > FLOAT32_MAX:  # the advantages are computed in float32
            raise ValueError(
                f"sample {s.index} has reward {s.reward}, past float32's range (+-{FLOAT32_MAX:.4g}"
                f"; the advantages are float32): refused before the optimizer step; prompt "
                f"{s.prompt[:80]!r}, response {s.response_text[:80]!r}"
            )


def reward_metrics(samples) -> dict[str, float]:
    """``reward/<name>``: the mean of each extra metric over the samples that report it.

    Args:
        samples: ``rollout.types.Sample``s; ``Sample.reward_metrics`` holds each one's extras.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in samples:
        for name, value in s.reward_metrics.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {f"reward/{name}": sums[name] / counts[name] for name in sorted(sums)}
