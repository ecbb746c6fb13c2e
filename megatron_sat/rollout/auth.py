"""SGLang's HTTP authentication: API keys, the three endpoint auth levels, the decision rule.

Facts from sglang 0.5.23 (``srt/utils/auth.py``, ``srt/entrypoints/http_server.py``,
``srt/arg_groups/fields/serving.py``):

- ``--api-key`` and ``--admin-api-key`` (also settable in the YAML given to ``--config``, keys
  ``api_key`` / ``admin_api_key``); the client sends ``Authorization: Bearer <key>``.
- Every route has a level: ``normal`` (the default), ``admin_optional`` (the control routes:
  ``/flush_cache``, pause/continue, every weight-update route, ...) or ``admin_force``.
- ``decide_request_auth``: OPTIONS and paths starting ``/health``, ``/ready`` or ``/metrics``
  are always allowed. ``admin_force``: 403 without a configured admin key, else the admin key.
  ``admin_optional``: the admin key if one is configured (the API key is then refused), else
  the API key if configured, else open. ``normal``: the API key if configured (the admin key is
  not accepted for it), else open.
- A refused request gets ``{"error": "Unauthorized"}`` (401) or ``{"error": "Forbidden"}``
  (403).

``ENDPOINT_AUTH_LEVELS`` lists the level of every route this project calls or serves; the
conformance tests check it against the ``@auth_level`` decorators of SGLang's own routes.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import yaml


class AuthLevel(str, Enum):  # noqa: UP042 -- as SGLang declares it
    """SGLang's per-endpoint auth level (``srt/utils/auth.py:AuthLevel``)."""

    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


# The level of each route we use, as SGLang 0.5.23 decorates it (absent decorator = NORMAL).
ENDPOINT_AUTH_LEVELS: dict[str, AuthLevel] = {
    "/health": AuthLevel.NORMAL,
    "/health_generate": AuthLevel.NORMAL,
    "/ready": AuthLevel.NORMAL,
    "/model_info": AuthLevel.NORMAL,
    "/server_info": AuthLevel.NORMAL,
    "/get_server_info": AuthLevel.NORMAL,
    "/generate": AuthLevel.NORMAL,
    "/flush_cache": AuthLevel.ADMIN_OPTIONAL,
    "/pause_generation": AuthLevel.ADMIN_OPTIONAL,
    "/continue_generation": AuthLevel.ADMIN_OPTIONAL,
    "/init_weights_update_group": AuthLevel.ADMIN_OPTIONAL,
    "/destroy_weights_update_group": AuthLevel.ADMIN_OPTIONAL,
    "/begin_weight_update": AuthLevel.ADMIN_OPTIONAL,
    "/end_weight_update": AuthLevel.ADMIN_OPTIONAL,
    "/update_weights_from_distributed": AuthLevel.ADMIN_OPTIONAL,
}


@dataclass(frozen=True)
class AuthDecision:
    """Whether a request passes; ``error_status_code`` (401 or 403) when it does not."""

    allowed: bool
    error_status_code: int = 401


def _bearer_matches(authorization_header: str | None, expected: str) -> bool:
    if not authorization_header:
        return False
    parts = authorization_header.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return hmac.compare_digest(parts[1].encode(), expected.encode())


def decide_request_auth(
    *,
    method: str,
    path: str,
    authorization_header: str | None,
    api_key: str | None,
    admin_api_key: str | None,
    auth_level: AuthLevel,
) -> AuthDecision:
    """SGLang's decision for one request (same rule as its ``decide_request_auth``, see the
    module docstring); a pure function so the tests can compare the two on every input."""
    if method == "OPTIONS":
        return AuthDecision(True)
    if path.startswith(("/health", "/ready", "/metrics")):
        return AuthDecision(True)
    if auth_level == AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return AuthDecision(False, 403)
        return AuthDecision(_bearer_matches(authorization_header, admin_api_key))
    if auth_level == AuthLevel.ADMIN_OPTIONAL:
        if admin_api_key:
            return AuthDecision(_bearer_matches(authorization_header, admin_api_key))
        if api_key:
            return AuthDecision(_bearer_matches(authorization_header, api_key))
        return AuthDecision(True)
    if api_key:
        return AuthDecision(_bearer_matches(authorization_header, api_key))
    return AuthDecision(True)


def auth_error_body(decision: AuthDecision) -> dict[str, str]:
    """SGLang's body of a refused request."""
    return {"error": "Unauthorized" if decision.error_status_code == 401 else "Forbidden"}


@dataclass(frozen=True, repr=False)
class ServerKeys:
    """The keys of a server (either may be None); ``repr`` never shows them.

    Attributes:
        api_key: SGLang's ``--api-key``.
        admin_api_key: SGLang's ``--admin-api-key``.
    """

    api_key: str | None = None
    admin_api_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key is None:
                continue
            # Never show the key. A header value cannot hold a control character (httpx
            # raises with the whole header, key included, in its message), HTTP servers strip
            # surrounding whitespace, and SGLang's secrets.compare_digest raises TypeError
            # (a 500 on every request) for a non-ASCII str.
            ok = isinstance(key, str) and key.isascii() and key.isprintable()
            if not ok or not key or key != key.strip():
                raise ValueError(
                    f"ServerKeys.{name} must be a non-empty string of printable ASCII without "
                    "surrounding whitespace (the key is not shown)"
                )

    def __repr__(self) -> str:
        def shown(key: str | None) -> str:
            return "None" if key is None else "'***'"

        return (
            f"ServerKeys(api_key={shown(self.api_key)}, admin_api_key={shown(self.admin_api_key)})"
        )

    def header_for(self, endpoint: str) -> dict[str, str]:
        """The ``Authorization`` header SGLang wants on ``endpoint`` (empty when none)."""
        level = ENDPOINT_AUTH_LEVELS.get(endpoint.split("?", 1)[0], AuthLevel.NORMAL)
        if level == AuthLevel.NORMAL:
            key = self.api_key
        else:  # admin routes take the admin key when the server has one, else the API key
            key = self.admin_api_key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def generate_server_keys() -> ServerKeys:
    """Fresh API and admin API keys (``sk-`` + 32 random bytes, URL-safe: as the rendered
    multi-node scripts make them), for embedded servers the trainer starts itself."""
    return ServerKeys(
        api_key="sk-" + secrets.token_urlsafe(32),
        admin_api_key="sk-" + secrets.token_urlsafe(32),
    )


def load_server_keys(path: str | os.PathLike) -> ServerKeys:
    """Read a key file: YAML with ``api-key`` and/or ``admin-api-key`` (the file SGLang's
    ``--config`` reads, which needs the flags' spelling; ``api_key`` is accepted here too),
    readable by its owner only. The one rule for key files: the trainer
    (``rollout.server_key_file``) and the embedded server (``--config``) both read them here.

    Raises:
        ValueError: naming the file when group or others may read it, when it has other keys,
            or when a key is not a non-empty string.
        FileNotFoundError: when it does not exist.
    """
    p = Path(path)
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"server key file {p} has mode {oct(mode & 0o777)}; it must be 0600")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"server key file {p}: a mapping of api-key / admin-api-key expected")
    # SGLang's --config takes the flags' spelling (api-key); the dest spelling is read too.
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    if set(data) - {"api_key", "admin_api_key"}:
        raise ValueError(f"server key file {p}: only api-key and admin-api-key are allowed")
    for name, value in data.items():
        if not isinstance(value, str) or not value:
            raise ValueError(f"server key file {p}: {name} must be a non-empty string")
    return ServerKeys(data.get("api_key"), data.get("admin_api_key"))
