"""Load and save Hugging Face checkpoints (safetensors + config.json + tokenizer) for a
megatron-core model on a single model-parallel rank (TP = EP = PP = 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_sat.checkpoint.hf_map import hf_to_mcore, mcore_to_hf

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF checkpoint directory."""
    return json.loads((Path(path) / "config.json").read_text())


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``, by on-disk name.

    Raises:
        FileNotFoundError: when the directory holds no safetensors file.
        ValueError: when two files hold the same tensor name.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in tensors:
                    raise ValueError(f"tensor {key!r} appears twice ({file.name})")
                tensors[key] = f.get_tensor(key)
    return tensors


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def load_hf_into_model(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the HF checkpoint at ``path`` into the megatron-core ``model`` in place.

    Raises:
        ValueError: for missing, unused or mis-shaped tensors, naming them.
    """
    model = _unwrap(model)
    hf_config = read_hf_config(path)
    params = dict(model.named_parameters())
    mapped = hf_to_mcore(read_hf_tensors(path), list(params), hf_config)
    with torch.no_grad():
        for name, param in params.items():
            src = mapped[name]
            if src.shape != param.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(param.shape)}"
                )
            param.copy_(src.to(param.dtype))


def export_hf_tensors(model: torch.nn.Module, hf_config: dict[str, Any]):
    """Yield ``(hf_name, tensor)`` of the full model (single model-parallel rank)."""
    model = _unwrap(model)
    named = ((n, p.detach()) for n, p in model.named_parameters())
    yield from mcore_to_hf(named, hf_config)


def save_model_as_hf(
    model: torch.nn.Module,
    hf_config: dict[str, Any],
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as an HF checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads.

    Writes ``model.safetensors`` (per-expert keys), ``config.json`` and, from
    ``tokenizer_dir``, the tokenizer files.

    Raises:
        FileExistsError: when ``out_dir`` holds a checkpoint and ``overwrite`` is False.
    """
    out = Path(out_dir)
    if (out / "model.safetensors").exists() and not overwrite:
        raise FileExistsError(f"{out} already holds a checkpoint (pass overwrite=True)")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().clone() for k, v in export_hf_tensors(model, hf_config)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (out / name).resolve():
                shutil.copy(src, out / name)
    return out
