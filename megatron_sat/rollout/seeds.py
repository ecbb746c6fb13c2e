"""Per-request sampling seeds: what a sample draws depends on where it is in the run, not on
a server's state.

SGLang 0.5.23 takes ``sampling_params.sampling_seed`` (an int64) per request and, with
``--enable-deterministic-inference``, samples each token with Gumbel noise hashed from
(seed, token position, vocabulary index) (``srt/layers/sampler.py``:
``multinomial_with_seed``); our embedded server honours it the same way. Deriving the seed
from (run seed, step, prompt index, sample index) makes a resumed run, or a run whose server
was restarted mid-generation, draw exactly what the uninterrupted run drew: no sampler state
has to be saved or restored.
"""

from __future__ import annotations

import hashlib

PURPOSES = ("train", "eval")


def request_seed(
    run_seed: int, step: int, prompt_index: int, sample_index: int, purpose: str = "train"
) -> int:
    """The ``sampling_seed`` of one request, in [0, 2**63) (SGLang's int64 range).

    Args:
        run_seed: ``train.seed``.
        step: the optimizer step the sample is for (its batch), or the step after which an
            evaluation runs (0: before training).
        prompt_index: the prompt's position in the run's prompt stream (train: the data
            position, unique over the run) or in the held-out set (eval).
        sample_index: the sample's index within its group (0 .. group_size - 1).
        purpose: ``train`` or ``eval`` (separate seed streams).

    Raises:
        ValueError: for an unknown purpose or a negative index.
    """
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    if min(step, prompt_index, sample_index) < 0:
        raise ValueError(
            f"step ({step}), prompt_index ({prompt_index}) and sample_index ({sample_index}) "
            "must be >= 0"
        )
    key = f"{purpose}:{run_seed}:{step}:{prompt_index}:{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
