"""One rule for server key files, read by the trainer and the embedded server alike
(``rollout.auth.load_server_keys``), and generated keys for the embedded servers the trainer
starts (``training.engines.embedded_server_options``)."""

from __future__ import annotations

import pytest

from megatron_sat.config import load_config
from megatron_sat.rollout.auth import generate_server_keys, load_server_keys
from megatron_sat.rollout.embedded.server import parse_args
from megatron_sat.training.engines import embedded_server_options


def test_generated_keys_are_fresh_and_shaped_like_the_scripts():
    a, b = generate_server_keys(), generate_server_keys()
    assert a.api_key.startswith("sk-") and a.admin_api_key.startswith("sk-")
    assert len(a.api_key) == 3 + 43  # token_urlsafe(32): 43 characters
    assert len({a.api_key, a.admin_api_key, b.api_key, b.admin_api_key}) == 4
    assert "sk-" not in repr(a)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_the_embedded_server_refuses_a_key_file_others_can_read(tmp_path, mode):
    path = tmp_path / "keys.yaml"
    path.write_text("api-key: sk-abc\n")
    path.chmod(mode)
    for read in (load_server_keys, lambda p: parse_args(["--model-path", "m", "--config", p])):
        with pytest.raises(ValueError, match=f"{path} has mode {oct(mode)}; it must be 0600"):
            read(str(path))


def test_the_embedded_server_reads_a_0600_key_file_and_a_flag_wins(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("api-key: sk-file\nadmin-api-key: sk-admin\n")
    path.chmod(0o600)
    cfg = parse_args(["--model-path", "m", "--config", str(path)])
    assert (cfg.api_key, cfg.admin_api_key) == ("sk-file", "sk-admin")
    cfg = parse_args(["--model-path", "m", "--config", str(path), "--api-key", "sk-flag"])
    assert (cfg.api_key, cfg.admin_api_key) == ("sk-flag", "sk-admin")
    path.write_text("api-key: sk-file\nport: 1\n")
    with pytest.raises(ValueError, match="only api-key and admin-api-key are allowed"):
        parse_args(["--model-path", "m", "--config", str(path)])


def test_embedded_servers_started_by_the_trainer_get_their_own_keys():
    cfg = load_config(None, ["train.seed=7"])
    first, second = embedded_server_options(cfg, 0), embedded_server_options(cfg, 1)
    assert first["random_seed"] == 7 and second["random_seed"] == 8
    assert first["keys"].api_key.startswith("sk-")
    assert first["keys"].api_key != second["keys"].api_key
