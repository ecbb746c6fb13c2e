"""The thread policy of platform/threads.py: the decision (pure), its precedence, and its
effect on a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sat.platform.threads import CHOSEN_ENV, configure_threads, decide_threads

ROOT = Path(__file__).resolve().parents[1]
WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


@pytest.mark.parametrize(
    "cores,procs,expected",
    [(2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 4, 4), (16, 3, 5), (1, 1, 1), (64, 8, 8)],
)
def test_count_from_affinity_and_processes(cores, procs, expected):
    policy = decide_threads(num_local_processes=procs, environ={}, affinity=range(cores))
    assert policy.num_threads == expected
    assert policy.source == "affinity"
    assert policy.num_cores == cores
    assert policy.num_interop_threads == min(expected, 2)
    assert policy.env == {
        **WAIT,
        "OMP_NUM_THREADS": str(expected),
        CHOSEN_ENV: str(expected),
    }


def test_affinity_is_a_set_of_cpu_ids():
    assert decide_threads(environ={}, affinity=[0, 0, 3]).num_threads == 2


def test_user_omp_num_threads_wins_over_everything():
    env = {"OMP_NUM_THREADS": "3", "MEGATRON_SAT_THREADS": "5"}
    policy = decide_threads(threads=7, num_local_processes=4, environ=env, affinity=range(2))
    assert (policy.num_threads, policy.source) == (3, "OMP_NUM_THREADS")
    assert policy.env == WAIT  # the user's OMP_NUM_THREADS is left as it is
    nested = decide_threads(environ={"OMP_NUM_THREADS": "4,2"}, affinity=range(2))
    assert nested.num_threads == 4


def test_megatron_sat_threads_then_argument():
    env = {"MEGATRON_SAT_THREADS": "5"}
    policy = decide_threads(threads=7, environ=env, affinity=range(2))
    assert (policy.num_threads, policy.source) == (5, "MEGATRON_SAT_THREADS")
    policy = decide_threads(threads=7, num_local_processes=2, environ={}, affinity=range(2))
    assert (policy.num_threads, policy.source) == (7, "argument")


def test_user_wait_policy_is_kept():
    env = {"OMP_WAIT_POLICY": "ACTIVE", "KMP_BLOCKTIME": "200"}
    policy = decide_threads(environ=env, affinity=range(2))
    assert policy.env == {"OMP_NUM_THREADS": "2", CHOSEN_ENV: "2"}


def test_a_parent_choice_is_not_taken_for_the_users():
    env = {"OMP_NUM_THREADS": "2", CHOSEN_ENV: "2", **WAIT}
    policy = decide_threads(threads=1, environ=env, affinity=range(2))
    assert (policy.num_threads, policy.source) == (1, "argument")
    assert policy.env == {"OMP_NUM_THREADS": "1", CHOSEN_ENV: "1"}
    # ... but a user who set another count after the parent did is obeyed
    env["OMP_NUM_THREADS"] = "3"
    assert decide_threads(threads=1, environ=env, affinity=range(2)).num_threads == 3


@pytest.mark.parametrize(
    "kwargs,env,message",
    [
        ({"num_local_processes": 0}, {}, "num_local_processes must be a positive integer, got 0"),
        ({"threads": 0}, {}, "threads must be a positive integer, got 0"),
        ({}, {"OMP_NUM_THREADS": "two"}, "OMP_NUM_THREADS must be a positive integer, got 'two'"),
        ({}, {"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS must be a positive integer, got '0'"),
        (
            {},
            {"MEGATRON_SAT_THREADS": "-1"},
            "MEGATRON_SAT_THREADS must be a positive integer, got '-1'",
        ),
    ],
)
def test_bad_values_are_named(kwargs, env, message):
    with pytest.raises(ValueError) as info:
        decide_threads(environ=env, affinity=range(2), **kwargs)
    assert str(info.value) == message


def test_empty_affinity_is_refused():
    with pytest.raises(ValueError, match="affinity of this process is empty"):
        decide_threads(environ={}, affinity=[])


def test_configure_after_torch_sets_counts_and_warns():
    import torch

    before = torch.get_num_threads()
    env = {"MEGATRON_SAT_THREADS": "1"}
    try:
        with pytest.warns(RuntimeWarning, match="ran after torch was imported"):
            policy = configure_threads(environ=env)
        assert torch.get_num_threads() == policy.num_threads == 1
        assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


_PROBE = """
import json, os, sys
from megatron_sat.platform.threads import configure_threads
policy = configure_threads(num_local_processes=int(sys.argv[1]))
assert "torch" not in sys.modules, "configure_threads imported torch"
import torch
child = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
print(json.dumps({"chosen": policy.num_threads, "source": policy.source,
                  "torch": torch.get_num_threads(), "env": child}))
"""


def _probe(env: dict[str, str], procs: int = 1) -> dict:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", CHOSEN_ENV)
        and k != "MEGATRON_SAT_THREADS"
    }
    clean.update(env, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(procs)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fresh_process_gets_the_chosen_count():
    cores = len(os.sched_getaffinity(0))
    got = _probe({}, procs=1)
    assert got["chosen"] == got["torch"] == cores and got["source"] == "affinity"
    assert got["env"] == {
        "OMP_NUM_THREADS": str(cores),
        "OMP_WAIT_POLICY": "PASSIVE",
        **{"KMP_BLOCKTIME": "0"},
    }
    got = _probe({"MEGATRON_SAT_THREADS": "1"})
    assert got["chosen"] == got["torch"] == 1 and got["source"] == "MEGATRON_SAT_THREADS"


def test_fresh_process_keeps_the_users_omp_num_threads():
    got = _probe({"OMP_NUM_THREADS": "1", "MEGATRON_SAT_THREADS": "2"}, procs=1)
    assert got["chosen"] == got["torch"] == 1 and got["source"] == "OMP_NUM_THREADS"
    assert got["env"]["OMP_NUM_THREADS"] == "1" and got["env"]["OMP_WAIT_POLICY"] == "PASSIVE"


def test_cli_program_applies_the_policy_before_torch():
    code = (
        "import os, sys\n"
        "from megatron_sat import cli\n"
        "sys.argv = ['megatron-sat', '--help']\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "PASSIVE False"


def test_empty_omp_num_threads_is_unset():
    """``OMP_NUM_THREADS=`` (set but empty) means unset, as OpenMP reads it: the next source
    decides, and every CLI command keeps working (it refused to start, found by review)."""
    policy = decide_threads(environ={"OMP_NUM_THREADS": " "}, affinity=range(4))
    assert (policy.num_threads, policy.source) == (4, "affinity")


@pytest.mark.parametrize(
    "env,procs,expected",
    [
        ({"MEGATRON_SAT_LOCAL_PROCESSES": "3"}, 1, 5),  # a sweep's --jobs 3 on 16 cores
        ({"LOCAL_WORLD_SIZE": "4"}, 1, 4),  # torchrun's 4 ranks of this node
        ({"MEGATRON_SAT_LOCAL_PROCESSES": "2", "LOCAL_WORLD_SIZE": "4"}, 1, 2),
        ({"MEGATRON_SAT_LOCAL_PROCESSES": "2"}, 2, 4),  # times the caller's own count
        ({"MEGATRON_SAT_LOCAL_PROCESSES": "32"}, 1, 1),  # at least one
        ({"MEGATRON_SAT_LOCAL_PROCESSES": ""}, 1, 16),  # empty: unset
    ],
)
def test_siblings_from_the_environment_share_the_cores(env, procs, expected):
    policy = decide_threads(num_local_processes=procs, environ=env, affinity=range(16))
    assert (policy.num_threads, policy.source) == (expected, "affinity")


def test_siblings_do_not_override_explicit_counts():
    env = {"MEGATRON_SAT_LOCAL_PROCESSES": "4", "MEGATRON_SAT_THREADS": "3"}
    assert decide_threads(environ=env, affinity=range(16)).num_threads == 3


@pytest.mark.parametrize("name", ["MEGATRON_SAT_LOCAL_PROCESSES", "LOCAL_WORLD_SIZE"])
def test_bad_sibling_counts_are_named(name):
    with pytest.raises(ValueError) as info:
        decide_threads(environ={name: "0"}, affinity=range(2))
    assert str(info.value) == f"{name} must be a positive integer, got '0'"


def test_child_env_multiplies_the_inherited_share():
    from megatron_sat.platform.threads import child_env

    assert child_env(3, environ={}) == {"MEGATRON_SAT_LOCAL_PROCESSES": "3"}
    # a sweep cell (share 3) that starts 2 embedded servers: each server is 1 of 6
    assert child_env(2, environ={"MEGATRON_SAT_LOCAL_PROCESSES": "3"}) == {
        "MEGATRON_SAT_LOCAL_PROCESSES": "6"
    }
    with pytest.raises(ValueError, match="num_siblings must be a positive integer, got 0"):
        child_env(0, environ={})


def test_fresh_child_process_takes_its_share():
    got = _probe({"MEGATRON_SAT_LOCAL_PROCESSES": "2", "LOCAL_WORLD_SIZE": "1"})
    cores = len(os.sched_getaffinity(0))
    assert got["chosen"] == got["torch"] == max(1, cores // 2) and got["source"] == "affinity"
