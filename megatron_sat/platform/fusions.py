"""The layer spec and the megatron-core fusions of this process, chosen by what imports.

Each choice is on exactly when the module it needs imports (on a CUDA machine), decided once
per process by :func:`device_fusions` and printed once at start-up (:func:`announce_fusions`);
``platform.distributed.init_distributed`` takes the decision before megatron-core is imported:

- the transformer-engine layer spec needs ``transformer_engine.pytorch`` (TE >=
  :data:`TE_MIN_VERSION`): megatron-core's ``extensions/transformer_engine.py``;
- ``apply_rope_fusion`` needs TE's fused RoPE (``fused_apply_rotary_pos_emb``):
  ``TransformerConfig.__post_init__`` raises without it;
- ``moe_grouped_gemm`` needs TE's ``GroupedLinear`` (experts as ``TEGroupedMLP``):
  ``TESpecProvider.grouped_mlp_modules``; the local spec has only ``SequentialMLP``;
- ``moe_permute_fusion`` needs TE's ``transformer_engine.pytorch.permutation`` (TE >= 2.1):
  ``moe_utils.permute`` / ``unpermute`` raise without it;
- ``gradient_accumulation_fusion`` needs apex's CUDA extension
  ``fused_weight_gradient_mlp_cuda``: ``ColumnParallelLinear.__init__`` raises without it.

Why apex for ``gradient_accumulation_fusion`` even with TE: TE's linear layers fuse the weight
gradient themselves (``fuse_wgrad_accumulation``), but the output layer is always megatron-core's
local ``ColumnParallelLinear`` (``GPTModel``), whose constructor raises ``RuntimeError:
fused_weight_gradient_mlp_cuda module is not found`` without apex (``tensor_parallel/layers.py``),
and the field is one for the whole model.

Why ``moe_permute_fusion`` keeps R3 exact: the fused permutation runs in the token dispatcher
(``token_dispatcher.py``: ``permute(..., fused=config.moe_permute_fusion)``) on the
``routing_map`` / ``probs`` the router returned, after ``TopKRouter.routing`` called
``topk_routing_with_score_function(..., router_replay=self.router_replay)``; it selects no
expert itself. The fused *top-k* (``moe_router_fusion``) is different: that function returns
``fused_topk_with_score_function(...)`` before it reaches the ``RouterReplay`` hook
(``moe_utils.py``), so it stays off (``routing.replay.check_replayable`` refuses it).

``grouped_gemm`` (the CUTLASS package of megatron-core's old ``GroupedMLP``) is not probed:
megatron-core 0.19 removed that class and imports the package nowhere; grouped GEMM is TE's
``GroupedLinear``. So it is neither needed nor harmful, whatever state it is in.

A module that is installed but fails to import (a CUDA / ABI mismatch, a TE without its torch
extension, a TE older than :data:`TE_MIN_VERSION`) is refused with :class:`BrokenInstallError`
naming the package, on every machine: megatron-core imports TE and apex itself with
``except ImportError``, so such a module would otherwise either crash megatron-core's import
with an unrelated traceback (an ``OSError`` from a missing CUDA library) or be dropped silently
(an ``ImportError``), turning a GPU run into a local-spec run several times slower.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from typing import Literal

# The floor of the [gpu] extra (setup.py). What is turned on here needs less: TEGroupedLinear
# (TE >= 1.9), fused permutation (>= 2.1), fused RoPE (>= 1.4), per megatron-core 0.19.2.
TE_MIN_VERSION = "2.6"

ProbeState = Literal["present", "absent", "broken"]


class BrokenInstallError(RuntimeError):
    """A GPU library that is installed but cannot be used (the message names the package)."""


@dataclass(frozen=True)
class ModuleProbe:
    """The result of importing one module.

    Attributes:
        module: the import name (``transformer_engine.pytorch``).
        package: what to install to get it (``transformer_engine[pytorch]``).
        state: ``present`` (it imported), ``absent`` (the module itself, or its top-level
            package, is not installed) or ``broken`` (it is there but importing it raised, or
            something it imports is missing).
        detail: the version for a present module where one is known, else the error.
    """

    module: str
    package: str
    state: ProbeState
    detail: str = ""


def _is_missing_itself(err: ModuleNotFoundError, module: str) -> bool:
    """Whether ``err`` says ``module`` (or one of its parent packages) is not installed, as
    opposed to a module it imports in turn."""
    missing = err.name or ""
    return bool(missing) and (module == missing or module.startswith(missing + "."))


def probe_module(module: str, package: str) -> ModuleProbe:
    """Import ``module`` and say whether it is present, absent or broken (never raises)."""
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if _is_missing_itself(err, module):
            return ModuleProbe(module, package, "absent", f"{type(err).__name__}: {err}")
        return ModuleProbe(module, package, "broken", f"{type(err).__name__}: {err}")
    except Exception as err:  # any failure (OSError, RuntimeError, ...) is a broken install
        return ModuleProbe(module, package, "broken", f"{type(err).__name__}: {err}")
    top = sys.modules.get(module.split(".")[0], imported)
    version = getattr(top, "__version__", "")
    return ModuleProbe(module, package, "present", str(version))


def _version_tuple(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string (``2.20.2+cu12`` -> (2, 20, 2))."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in match.group(0).split("."))


def probe_transformer_engine() -> ModuleProbe:
    """transformer-engine's PyTorch side (what megatron-core's TE spec imports), its version
    checked against :data:`TE_MIN_VERSION` (an older one is ``broken``)."""
    probe = probe_module("transformer_engine.pytorch", "transformer_engine[pytorch]")
    if probe.state != "present":
        return probe
    version = probe.detail
    if not version:
        try:
            version = importlib.metadata.version("transformer-engine")
        except importlib.metadata.PackageNotFoundError:
            version = ""
    try:
        too_old = _version_tuple(version) < _version_tuple(TE_MIN_VERSION)
    except ValueError:
        return dataclasses.replace(
            probe, state="broken", detail=f"imports but reports no version ({version!r})"
        )
    if too_old:
        return dataclasses.replace(
            probe,
            state="broken",
            detail=f"version {version} is older than the {TE_MIN_VERSION} megatron-sat needs",
        )
    return dataclasses.replace(probe, detail=version)


def probe_apex_wgrad() -> ModuleProbe:
    """apex's CUDA extension for the fused weight-gradient accumulation (a top-level module
    that ``apex``'s ``--cuda_ext`` build installs; the PyPI project named ``apex`` is another
    one and does not provide it)."""
    return probe_module("fused_weight_gradient_mlp_cuda", "apex (built with --cuda_ext)")


@dataclass(frozen=True)
class DeviceFusions:
    """The layer spec and fusion fields of megatron-core's ``TransformerConfig`` for this
    process, with the reason for each one that is off.

    Attributes:
        device_type: ``cuda`` or ``cpu``.
        transformer_engine: build with megatron-core's transformer-engine layer spec
            (``transformer_impl="transformer_engine"``), else the local spec.
        apply_rope_fusion, moe_grouped_gemm, moe_permute_fusion: TE's fused RoPE, grouped
            expert GEMMs (TEGroupedMLP) and fused token permutation.
        gradient_accumulation_fusion: the weight gradient accumulated into ``main_grad`` in
            the GEMM (apex's kernel for megatron-core's local linears, TE's for TE's).
        bias_activation_fusion, bias_dropout_fusion, masked_softmax_fusion: megatron-core's
            own fused SwiGLU / bias-dropout-add (torch.jit) and softmax (it checks its kernel
            and falls back by itself): on with CUDA.
        off: ``(field, why)`` for each field above that is off.
        probes: the import probes the decision rests on.
    """

    device_type: str
    transformer_engine: bool
    apply_rope_fusion: bool
    moe_grouped_gemm: bool
    moe_permute_fusion: bool
    gradient_accumulation_fusion: bool
    bias_activation_fusion: bool
    bias_dropout_fusion: bool
    masked_softmax_fusion: bool
    off: tuple[tuple[str, str], ...] = ()
    probes: tuple[ModuleProbe, ...] = ()

    def transformer_config_fields(self) -> dict[str, object]:
        """The device's ``TransformerConfig`` fields: CPU initialisation only on the CPU (on
        CUDA megatron-core initialises each shard on the device), the spec, the fusions;
        ``persist_layer_norm`` (apex's LayerNorm kernel, not used by RMSNorm) and
        ``moe_router_fusion`` (skips ``RouterReplay``: see the module docstring) off."""
        return dict(
            use_cpu_initialization=self.device_type != "cuda",
            transformer_impl="transformer_engine" if self.transformer_engine else "local",
            bias_activation_fusion=self.bias_activation_fusion,
            bias_dropout_fusion=self.bias_dropout_fusion,
            masked_softmax_fusion=self.masked_softmax_fusion,
            persist_layer_norm=False,
            apply_rope_fusion=self.apply_rope_fusion,
            moe_grouped_gemm=self.moe_grouped_gemm,
            moe_permute_fusion=self.moe_permute_fusion,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            moe_router_fusion=False,
        )

    def summary(self) -> str:
        """One line per choice: ``on`` or ``off (why)``, for the start-up log."""
        lines = [f"layer spec and fusions on {self.device_type}:"]
        why = dict(self.off)
        for field in _CHOICES:
            on = getattr(self, field)
            lines.append(f"  {field}: {'on' if on else 'off (' + why.get(field, '?') + ')'}")
        return "\n".join(lines)


_CHOICES = (
    "transformer_engine",
    "apply_rope_fusion",
    "moe_grouped_gemm",
    "moe_permute_fusion",
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
)

_TE_FIELDS = ("transformer_engine", "apply_rope_fusion", "moe_grouped_gemm", "moe_permute_fusion")
_CUDA_ONLY = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion")

# How to repair each broken install (docs/gpu.md has the commands).
_FIX = {
    "transformer_engine.pytorch": (
        "reinstall it into this torch with `pip install --no-build-isolation "
        f"'transformer_engine[pytorch]>={TE_MIN_VERSION}'` (docs/gpu.md), or uninstall "
        "transformer-engine to train with megatron-core's local spec"
    ),
    "fused_weight_gradient_mlp_cuda": (
        "rebuild apex against this torch with its --cpp_ext and --cuda_ext options (docs/gpu.md), "
        "or uninstall apex to train without the fused weight-gradient accumulation"
    ),
}


def decide_fusions(
    device_type: str, transformer_engine: ModuleProbe, apex_wgrad: ModuleProbe
) -> DeviceFusions:
    """The spec and fusions for ``device_type`` given the two import probes (pure).

    Raises:
        BrokenInstallError: a probe is ``broken``: names the package, the import error and
            the fix.
        ValueError: a device type other than ``cuda`` / ``cpu``.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    probes = (transformer_engine, apex_wgrad)
    broken = [p for p in probes if p.state == "broken"]
    if broken:
        raise BrokenInstallError(
            "; ".join(
                f"{p.package} is installed but `import {p.module}` fails ({p.detail}): "
                f"{_FIX.get(p.module, 'reinstall or uninstall it')}"
                for p in broken
            )
        )
    cuda = device_type == "cuda"
    te = cuda and transformer_engine.state == "present"
    wgrad = cuda and apex_wgrad.state == "present"
    off: list[tuple[str, str]] = []
    for field in _TE_FIELDS:
        if not cuda:
            off.append((field, "no CUDA"))
        elif not te:
            off.append((field, f"transformer-engine does not import: {transformer_engine.detail}"))
    if not cuda:
        off.append(("gradient_accumulation_fusion", "no CUDA"))
    elif not wgrad:
        off.append(
            (
                "gradient_accumulation_fusion",
                f"apex's fused_weight_gradient_mlp_cuda does not import (the output layer, "
                f"megatron-core's ColumnParallelLinear, needs it): {apex_wgrad.detail}",
            )
        )
    off += [(field, "no CUDA") for field in _CUDA_ONLY if not cuda]
    return DeviceFusions(
        device_type=device_type,
        transformer_engine=te,
        apply_rope_fusion=te,
        moe_grouped_gemm=te,
        moe_permute_fusion=te,
        gradient_accumulation_fusion=wgrad,
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda,
        off=tuple(off),
        probes=probes,
    )


def device_fusions(device_type: str | None = None) -> DeviceFusions:
    """This process's spec and fusions (probed once per device type and cached).

    Args:
        device_type: ``cuda`` or ``cpu``; None: this machine's (``platform.get_device()``).

    Raises:
        BrokenInstallError: transformer-engine or apex's extension is installed but broken.
    """
    if device_type is None:
        from megatron_sat.platform.device import get_device

        device_type = get_device().type
    return _decided(device_type)


@functools.cache
def _decided(device_type: str) -> DeviceFusions:
    return decide_fusions(device_type, probe_transformer_engine(), probe_apex_wgrad())


def have_transformer_engine() -> bool:
    """Whether this process builds with transformer-engine: CUDA present and
    ``transformer_engine.pytorch`` imports (:func:`device_fusions`, probed once).

    Raises:
        BrokenInstallError: transformer-engine is installed but fails to import.
    """
    return device_fusions().transformer_engine


_announced: set[str] = set()


def announce_fusions(fusions: DeviceFusions | None = None, *, rank: int = 0) -> bool:
    """Print :meth:`DeviceFusions.summary` once per process (on ``rank`` 0 only); returns
    whether it printed."""
    fusions = device_fusions() if fusions is None else fusions
    if rank != 0 or fusions.device_type in _announced:
        return False
    _announced.add(fusions.device_type)
    print("megatron-sat: " + fusions.summary(), flush=True)
    return True
