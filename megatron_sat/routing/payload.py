"""Wire format of routed experts: SGLang's base64 payload <-> compact numpy arrays.

SGLang (0.5.23, ``--enable-return-routed-experts``) returns ``meta_info["routed_experts"]`` as
the base64 of the raw bytes of an int32 array of shape
``[seqlen - 1 - routed_experts_start_len, num_hidden_layers, top_k]`` in native byte order
(little-endian on every platform SGLang runs on): one row per token except the last one, every
decoder layer (dense layers included; SGLang leaves them 0), experts in the router's top-k order.
Source: ``sglang/srt/state_capturer/routed_experts.py``,
``managers/scheduler_components/batch_result_processor.py``.

The trainer keeps routes compact: uint8 when ids fit (<= 256 experts), else int16, and widens
them to int64 only when installing them into a router (:mod:`megatron_sat.routing.slicing`).

Incremental rows: a request sent with ``routed_experts_start_len = n`` (a continued or resumed
generation whose first n rows the caller already holds) gets only rows ``n ..`` back;
:func:`extend_routed_experts` appends them to the rows held, checking that they line up.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import pybase64

_WIRE_DTYPE = np.dtype("<i4")
_WIRE_UNSIGNED = np.dtype("<u4")  # the same bytes: negative ids read as >= 2**31


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
    payload_b64: str | bytes | bytearray | memoryview,
    *,
    num_tokens: int,
    num_layers: int,
    top_k: int,
    num_experts: int,
) -> np.ndarray:
    """Decode SGLang's ``meta_info["routed_experts"]`` into a compact array.

    The payload may be the ``str`` of a parsed JSON body or a bytes-like view of the raw body
    (:func:`megatron_sat.routing.wire.split_routed_experts`), so that the base64 never becomes a
    Python string. Decoding is pybase64's validating decoder (SIMD; about 60x the stdlib's
    ``base64.b64decode(validate=True)``, bench/data_path.py), then one vectorised pass over the
    ids viewed as uint32 (a negative int32 is a uint32 >= 2**31, so ``max() < num_experts``
    checks both ends), then the cast to the compact dtype. Malformed payloads get the stdlib's
    exact error text (it re-runs on the error path only, to name the fault).

    Args:
        payload_b64: base64 of int32 little-endian bytes; ``str`` (ASCII) or bytes-like.
        num_tokens: expected rows, ``prompt_len + response_len - 1 - routed_experts_start_len``.
        num_layers: ``num_hidden_layers`` of the served model.
        top_k: ``num_experts_per_tok``.
        num_experts: routed experts per layer; every id must lie in [0, num_experts).

    Returns:
        Array [num_tokens, num_layers, top_k], uint8 if num_experts <= 256 else int16
        (C-contiguous, owning its memory: no reference to the payload is kept).

    Raises:
        ValueError: on invalid base64 (bad characters or padding, a data length that is not a
            multiple of 4), a byte length that does not match the expected shape (the message
            names expected and actual int32 counts), or an out-of-range expert id (the message
            names min, max and the first bad [token, layer, k]).
        TypeError: if the payload is neither ``str`` nor bytes-like.
    """
    for field, value in (("num_tokens", num_tokens), ("num_layers", num_layers), ("top_k", top_k)):
        if value < 0:
            raise ValueError(f"{field} must be >= 0, got {value}")
    out_dtype = compact_expert_dtype(num_experts)
    if not isinstance(payload_b64, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"routed_experts payload must be str or bytes-like, got {type(payload_b64).__name__}"
        )
    try:
        raw = pybase64.b64decode(payload_b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(
            f"routed_experts payload is not valid base64: {_base64_fault(payload_b64, e)}"
        ) from e
    expected = num_tokens * num_layers * top_k
    if len(raw) % _WIRE_DTYPE.itemsize != 0:
        raise ValueError(
            f"routed_experts payload has {len(raw)} bytes, not a multiple of 4 (int32); "
            f"expected {expected} int32 values for shape [{num_tokens}, {num_layers}, {top_k}]"
        )
    actual = len(raw) // _WIRE_DTYPE.itemsize
    if actual != expected:
        rows = actual / (num_layers * top_k) if num_layers * top_k else float("nan")
        layers = actual / (num_tokens * top_k) if num_tokens * top_k else float("nan")
        raise ValueError(
            f"routed_experts payload has {actual} int32 values, expected {expected} for shape "
            f"[num_tokens={num_tokens}, num_layers={num_layers}, top_k={top_k}]: it holds "
            f"{rows:g} rows of {num_layers}x{top_k}, or {layers:g} layers for {num_tokens} "
            f"tokens (the model has num_hidden_layers={num_layers}, dense layers included)"
        )
    as_unsigned = np.frombuffer(raw, dtype=_WIRE_UNSIGNED)
    if as_unsigned.size and int(as_unsigned.max()) >= num_experts:
        ids = np.frombuffer(raw, dtype=_WIRE_DTYPE).reshape(num_tokens, num_layers, top_k)
        lo, hi = int(ids.min()), int(ids.max())
        bad = np.argwhere((ids < 0) | (ids >= num_experts))[0].tolist()
        raise ValueError(
            f"routed_experts id out of range [0, {num_experts}): min {lo}, max {hi}; "
            f"first bad entry at [token, layer, k]={bad}"
        )
    return as_unsigned.astype(out_dtype).reshape(num_tokens, num_layers, top_k)


def _base64_fault(payload: str | bytes | bytearray | memoryview, fast_error: Exception) -> str:
    """The stdlib's words for why ``payload`` is not strict base64 (error path only).

    pybase64 says "Non-base64 digit found" for every fault; the stdlib names it (bad padding,
    a character outside the alphabet, a data length of 4n+1, non-ASCII text), and the messages
    callers and tests match on are the stdlib's. If the stdlib accepted what pybase64 refused,
    the two decoders disagree: say so with pybase64's message rather than hide it.
    """
    try:
        base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        return str(e)
    return f"{fast_error} (pybase64 refused it; the stdlib decoder accepts it)"


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


def extend_routed_experts(
    held: np.ndarray | None, increment: np.ndarray, *, start_len: int, num_experts: int
) -> np.ndarray:
    """Append rows decoded from a request sent with ``routed_experts_start_len=start_len``.

    SGLang returns rows ``start_len .. seqlen - 2`` for such a request (token positions; the
    last token never has a row), so the rows already held must be exactly rows
    ``0 .. start_len - 1``.

    Args:
        held: [start_len, num_layers, top_k] rows held so far (None or empty when start_len=0).
        increment: [n, num_layers, top_k] rows of the new response, as
            :func:`decode_routed_experts` returns them.
        start_len: the ``routed_experts_start_len`` the request was sent with.
        num_experts: routed experts per layer (picks the compact dtype).

    Returns:
        [start_len + n, num_layers, top_k] in the compact dtype for ``num_experts``.

    Raises:
        ValueError: when ``held`` does not hold exactly ``start_len`` rows, or the layer count or
            top_k of the two parts differ (each named).
    """
    if start_len < 0:
        raise ValueError(f"routed_experts_start_len must be >= 0, got {start_len}")
    increment = np.asarray(increment)
    if increment.ndim != 3:
        raise ValueError(f"increment must be [rows, layers, top_k], got shape {increment.shape}")
    dtype = compact_expert_dtype(num_experts)
    if held is None or (held.shape[0] == 0 and start_len == 0):
        if start_len != 0:
            raise ValueError(f"routed_experts_start_len={start_len} but no rows are held")
        return increment.astype(dtype)
    held = np.asarray(held)
    if held.shape[0] != start_len:
        raise ValueError(
            f"routed_experts_start_len={start_len} but {held.shape[0]} rows are held: the "
            f"increment would start at row {start_len}, not after the held rows"
        )
    if held.shape[1:] != increment.shape[1:]:
        raise ValueError(
            f"held rows are [.., {held.shape[1]} layers, top_k {held.shape[2]}] but the increment "
            f"is [.., {increment.shape[1]} layers, top_k {increment.shape[2]}]"
        )
    return np.concatenate([held.astype(dtype), increment.astype(dtype)], axis=0)
