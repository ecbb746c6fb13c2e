"""Build the model path on "a CUDA machine" whose GPU libraries are stubbed, in a fresh process.

    python tests/stubbed_build.py --te present --apex absent [--grouped-gemm present,absent]

megatron-core decides at import time whether TE and apex's kernel exist (``HAVE_TE``,
``_grad_accum_fusion_available``), so each TE x apex state needs its own process; the
``grouped_gemm`` states (which nothing may import) are looped over in one. With the stubs of
``tests/import_stubs.py`` installed before anything imports megatron-core, it runs the real
start-up: ``init_distributed`` (1-process gloo world; the fusion probe), then, with CUDA
reported available while the config is derived (the decision a CUDA machine takes), the real
``transformer_config_from_hf``; then, back on the CPU:

- the output layer exactly as ``GPTModel`` builds it (megatron-core's ``ColumnParallelLinear``:
  the constructor that raised ``fused_weight_gradient_mlp_cuda module is not found``);
- the decoder block spec the registry picks (``config.transformer_impl``): its attention and
  expert classes;
- without TE, the whole ``GPTModel`` (local spec: every module is real on the CPU).

Weights are allocated on the CPU (``use_cpu_initialization=True``, the one override): there
is no CUDA memory here. Prints one JSON line per grouped_gemm state: ``outcome`` (``built`` or
``refused``), ``error``, ``fields`` (the config's spec and fusion fields), ``spec``,
``output_layer`` and ``grouped_gemm_imported``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from import_stubs import StubFinder  # noqa: E402

FIELDS = (
    "transformer_impl",
    "use_cpu_initialization",
    "gradient_accumulation_fusion",
    "apply_rope_fusion",
    "moe_grouped_gemm",
    "moe_permute_fusion",
    "moe_router_fusion",
    "bias_activation_fusion",
)


@contextlib.contextmanager
def cuda_reported():
    """``torch.cuda`` says a device 0 exists, for the decision only (nothing runs on it)."""
    import torch

    saved = torch.cuda.is_available, torch.cuda.current_device
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.current_device = saved


def describe_spec(config) -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = getattr(config, "transformer_impl", "transformer_engine") == "transformer_engine"
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    layer = block.layer_specs[0].submodules
    experts = layer.mlp.keywords["submodules"].experts
    experts_cls = getattr(experts, "func", experts)
    return {
        "core_attention": layer.self_attention.submodules.core_attention.__name__,
        "experts": experts_cls.__name__,
    }


def build_once(hf: dict) -> dict:
    from megatron.core import tensor_parallel

    from megatron_sat.models import build_gpt_model, transformer_config_from_hf

    with cuda_reported():
        config = transformer_config_from_hf(hf, use_cpu_initialization=True)
    result = {"fields": {f: getattr(config, f, None) for f in FIELDS}}
    layer = tensor_parallel.ColumnParallelLinear(
        config.hidden_size,
        int(hf["vocab_size"]),
        config=config,
        init_method=config.init_method,
        bias=False,
        skip_bias_add=False,
        gather_output=False,
    )
    result["output_layer"] = list(layer.weight.shape)
    result["spec"] = describe_spec(config)
    if result["fields"]["transformer_impl"] != "transformer_engine":
        model = build_gpt_model(hf, config)
        result["model_parameters"] = sum(p.numel() for p in model.parameters())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--te", required=True)
    parser.add_argument("--apex", required=True)
    parser.add_argument("--grouped-gemm", default="absent", help="comma-separated states")
    args = parser.parse_args()
    states = {
        "transformer_engine": args.te,
        "apex": args.apex,
        "fused_weight_gradient_mlp_cuda": args.apex,
        "grouped_gemm": "absent",
    }
    finder = StubFinder(states).install()
    from megatron_sat.checkpoint.tiny_models import TINY_CONFIGS
    from megatron_sat.config import ParallelConfig

    hf = dict(TINY_CONFIGS["Qwen3MoeForCausalLM"], architectures=["Qwen3MoeForCausalLM"])
    for grouped_gemm in args.grouped_gemm.split(","):
        finder.states["grouped_gemm"] = grouped_gemm
        finder.forget()
        out: dict = {"te": args.te, "apex": args.apex, "grouped_gemm": grouped_gemm}
        try:
            from megatron_sat.platform.distributed import init_distributed

            init_distributed(ParallelConfig(), seed=1234)
            out.update(build_once(hf), outcome="built")
        except Exception as err:  # reported to the test, which asserts on it
            out.update(outcome="refused", error=f"{type(err).__name__}: {err}")
        out["grouped_gemm_imported"] = any(
            n.split(".")[0] == "grouped_gemm" for n in finder.requested
        )
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
