"""Wire format of routed experts: SGLang's base64 payload <-> compact numpy arrays.

SGLang (0.5.23, ``--enable-return-routed-experts``) returns ``meta_info["routed_experts"]`` as
the base64 of the raw bytes of an int32 array of shape
``[seqlen - 1 - routed_experts_start_len, num_hidden_layers, top_k]`` in native byte order
(little-endian on every platform SGLang runs on): one row per token except the last one, every
decoder layer (dense layers included; SGLang leaves them 0), experts in the router's top-k order.
Source: ``sglang/srt/state_capturer/routed_experts.py``,
``managers/scheduler_components/batch_result_processor.py``.

The trainer keeps routes compact: uint8 when ids fit (<= 256 experts), else int16.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

_WIRE_DTYPE = np.dtype("<i4")


def compact_expert_dtype(num_experts: int) -> np.dtype:
    """Smallest dtype that holds expert ids in [0, num_experts): uint8 up to 256, else int16.

    Raises:
        ValueError: if num_experts < 1 or > 32768 (beyond int16).
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 2**15:
        return np.dtype(np.int16)
    raise ValueError(f"num_experts={num_experts} exceeds int16 expert ids (max 32768)")


def decode_routed_experts(
    payload_b64: str, *, num_tokens: int, num_layers: int, top_k: int, num_experts: int
) -> np.ndarray:
    """Decode SGLang's ``meta_info["routed_experts"]`` into a compact array.

    Args:
        payload_b64: base64 of int32 little-endian bytes.
        num_tokens: expected rows, ``prompt_len + response_len - 1 - routed_experts_start_len``.
        num_layers: ``num_hidden_layers`` of the served model.
        top_k: ``num_experts_per_tok``.
        num_experts: routed experts per layer; every id must lie in [0, num_experts).

    Returns:
        Array [num_tokens, num_layers, top_k], uint8 if num_experts <= 256 else int16.

    Raises:
        ValueError: on invalid base64, a byte length that does not match the expected shape
            (the message names expected and actual int32 counts), or an out-of-range expert id.
    """
    for field, value in (("num_tokens", num_tokens), ("num_layers", num_layers), ("top_k", top_k)):
        if value < 0:
            raise ValueError(f"{field} must be >= 0, got {value}")
    out_dtype = compact_expert_dtype(num_experts)
    try:
        raw = base64.b64decode(payload_b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"routed_experts payload is not valid base64: {e}") from e
    expected = num_tokens * num_layers * top_k
    if len(raw) % _WIRE_DTYPE.itemsize != 0:
        raise ValueError(
            f"routed_experts payload has {len(raw)} bytes, not a multiple of 4 (int32); "
            f"expected {expected} int32 values for shape [{num_tokens}, {num_layers}, {top_k}]"
        )
    actual = len(raw) // _WIRE_DTYPE.itemsize
    if actual != expected:
        rows = actual / (num_layers * top_k) if num_layers * top_k else float("nan")
        raise ValueError(
            f"routed_experts payload has {actual} int32 values, expected {expected} for shape "
            f"[num_tokens={num_tokens}, num_layers={num_layers}, top_k={top_k}] "
            f"(payload holds {rows:g} rows of {num_layers}x{top_k})"
        )
    ids = np.frombuffer(raw, dtype=_WIRE_DTYPE).reshape(num_tokens, num_layers, top_k)
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            bad = np.argwhere((ids < 0) | (ids >= num_experts))[0].tolist()
            raise ValueError(
                f"routed_experts id out of range [0, {num_experts}): min {lo}, max {hi}; "
                f"first bad entry at [token, layer, k]={bad}"
            )
    return ids.astype(out_dtype)


def encode_routed_experts(arr: np.ndarray) -> str:
    """Encode [num_tokens, num_layers, top_k] integer expert ids as SGLang does (int32 base64).

    Raises:
        ValueError: if arr is not a 3-d integer array or holds ids outside int32.
    """
    arr = np.asarray(arr)
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"routed experts must be an integer array [tokens, layers, top_k], "
            f"got dtype {arr.dtype} shape {arr.shape}"
        )
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("routed expert ids do not fit int32")
    return base64.b64encode(arr.astype(_WIRE_DTYPE).tobytes()).decode("ascii")
