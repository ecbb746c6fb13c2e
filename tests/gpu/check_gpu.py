"""GPU checks of the GPU path; run on a CUDA machine: ``python tests/gpu/check_gpu.py``.

1. TE vs local layer spec: the same HF weights in a transformer-engine GPTModel and a local-spec
   GPTModel give the same logits (fp32). Compared twice: with live routing (a near-tie in a
   router may pick another expert), and with the TE model replaying the local model's routes
   (R3), which must agree to fp32 kernel tolerance.
2. One bf16 train step with R3: TE spec, bf16 parameters, Megatron DDP + optimizer (bf16, fp32
   main parameters); the routers use exactly the rollout routes (top-k match 1.0), the loss is
   finite and the weights change.
3. Weight sync over NCCL to an SGLang server on this machine (needs sglang and 2 GPUs: NCCL
   refuses two ranks on one device): the trainer pushes another checkpoint's weights; the
   server's weight_version and its greedy output change.

Prints one line per check with its timings and a final summary; exit status 0 when every check
that ran passed, 1 otherwise. Without CUDA it prints a SKIP line and exits 0 (what the CPU test
suite checks). Imports transformer-engine and sglang only here, lazily.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

MODEL = dict(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2)


def _to_cuda(mb):
    """The micro-batch with every tensor moved to the current CUDA device."""
    import torch

    changes = {
        f.name: getattr(mb, f.name).cuda()
        for f in dataclasses.fields(mb)
        if isinstance(getattr(mb, f.name), torch.Tensor)
    }
    return dataclasses.replace(mb, **changes)


def _build(hf, ckpt, *, te: bool, dtype):
    from megatron_sat.checkpoint.hf_io import load_hf_into_model
    from megatron_sat.models import build_gpt_model, transformer_config_from_hf

    config = transformer_config_from_hf(hf, params_dtype=dtype, moe_enable_routing_replay=True)
    model = build_gpt_model(hf, config, use_transformer_engine=te)
    load_hf_into_model(model, ckpt)
    return model.cuda(), config


def check_te_vs_local(hf, ckpt) -> str:
    import torch

    from megatron_sat.routing.replay import capture_routing, replay_routing

    t0 = time.time()
    local, _ = _build(hf, ckpt, te=False, dtype=torch.float32)
    te, _ = _build(hf, ckpt, te=True, dtype=torch.float32)
    t_build = time.time() - t0
    torch.manual_seed(0)
    ids = torch.randint(3, int(hf["vocab_size"]), (2, 48), device="cuda")
    pos = torch.arange(48, device="cuda").expand(2, -1)
    k = int(hf["num_experts_per_tok"])
    with torch.no_grad():
        with capture_routing(local) as used:
            ref = local(ids, pos, None).float()
        live = te(ids, pos, None).float()
        targets = {layer: m.float().topk(k, dim=1).indices for layer, m in used.items()}
        t1 = time.time()
        with replay_routing(te, targets, training=False):
            replayed = te(ids, pos, None).float()
        t_fwd = time.time() - t1
    scale = ref.abs().max().item()
    live_err = (live - ref).abs().max().item() / scale
    err = (replayed - ref).abs().max().item() / scale
    argmax = (replayed.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ok = err < 2e-3 and argmax > 0.99
    msg = (
        f"max |TE - local| / max|logits|: {err:.2e} with replayed routes, {live_err:.2e} live; "
        f"argmax agreement {argmax:.4f}; build {t_build:.1f} s, TE forward {t_fwd * 1e3:.1f} ms"
    )
    if not ok:
        raise AssertionError(msg)
    return msg


def _synthetic_samples(hf, num: int, prompt_len: int, response_len: int):
    import numpy as np

    from megatron_sat.rollout.types import Sample

    rng = np.random.default_rng(0)
    layers, k, e = int(hf["num_hidden_layers"]), int(hf["num_experts_per_tok"]), 8
    samples = []
    for i in range(num):
        tokens = prompt_len + response_len
        routes = np.stack(
            [np.stack([rng.permutation(e)[:k] for _ in range(layers)]) for _ in range(tokens - 1)]
        ).astype(np.uint8)
        samples.append(
            Sample(
                index=i,
                group_index=i // 2,
                prompt="p",
                label="l",
                prompt_ids=rng.integers(3, int(hf["vocab_size"]), prompt_len).tolist(),
                response_ids=rng.integers(3, int(hf["vocab_size"]), response_len).tolist(),
                rollout_log_probs=[-2.0] * response_len,
                response_versions=[0] * response_len,
                routed_experts=routes,
                reward=float(i % 2),
            )
        )
    return samples


def check_bf16_step_r3(hf, ckpt) -> str:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_sat.objectives import ObjectiveConfig, policy_loss
    from megatron_sat.routing.replay import capture_routing, replay_routing
    from megatron_sat.training.batching import build_micro_batch
    from megatron_sat.training.logprobs import forward_log_probs, routing_agreement

    model, config = _build(hf, ckpt, te=True, dtype=torch.bfloat16)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16),
        [ddp],
    )
    samples = _synthetic_samples(hf, num=4, prompt_len=8, response_len=24)
    shape = (config.num_layers, config.moe_router_topk, config.num_moe_experts)
    mb = _to_cuda(
        build_micro_batch(samples, [1.0, -1.0, 0.5, -0.5], pad_token_id=0, routing_shape=shape)
    )
    before = {n: p.detach().float().clone() for n, p in ddp.named_parameters()}
    ddp.train()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    torch.cuda.synchronize()
    t0 = time.time()
    with replay_routing(ddp, mb.routing_targets()), capture_routing(ddp) as used:
        log_probs = forward_log_probs(ddp, mb)
        loss, _ = policy_loss(
            log_probs,
            mb.rollout_log_probs,
            mb.advantages,
            mb.loss_mask,
            ObjectiveConfig(name="sat-gspo"),
        )
        loss.backward()
    ddp.finish_grad_sync()
    update_ok, grad_norm, _ = opt.step()
    torch.cuda.synchronize()
    t_step = time.time() - t0
    match = float(routing_agreement(used, mb)["topk_match"])
    changed = sum(not torch.equal(before[n], p.detach().float()) for n, p in ddp.named_parameters())
    dtypes = {p.dtype for p in ddp.parameters()}
    msg = (
        f"loss {float(loss):.4f}, grad norm {float(grad_norm):.3f}, top-k match with the "
        f"rollout routes {match:.4f}, {changed}/{len(before)} tensors changed, param dtypes "
        f"{sorted(map(str, dtypes))}; step {t_step * 1e3:.0f} ms"
    )
    ok = update_ok and torch.isfinite(loss) and match == 1.0 and changed == len(before)
    if not ok or dtypes != {torch.bfloat16}:
        raise AssertionError(msg)
    return msg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_nccl_weight_sync(ckpt_a, ckpt_b, log_dir: Path) -> str:
    import importlib.util

    import torch

    if torch.cuda.device_count() < 2:
        return "SKIP: needs 2 GPUs (NCCL refuses a trainer and a server rank on one device)"
    if importlib.util.find_spec("sglang") is None:
        return "SKIP: sglang is not installed (pip install -e .[gpu])"
    from megatron_sat.checkpoint.hf_io import read_hf_tensors
    from megatron_sat.rollout.client import SamplingParams, SGLangClient
    from megatron_sat.weight_sync.broadcast import WeightUpdater

    port = _free_port()
    log = (log_dir / "sglang_server.log").open("w")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(ckpt_a)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--tp-size", "1"]
    cmd += ["--enable-return-routed-experts", "--weight-version", "0"]
    cmd += ["--mem-fraction-static", "0.3", "--random-seed", "0"]
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, CUDA_VISIBLE_DEVICES="1")
    )
    try:
        client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=120)
        t0 = time.time()
        while not client.health():
            if server.poll() is not None or time.time() - t0 > 600:
                raise RuntimeError(f"SGLang server did not start; log {log.name}")
            time.sleep(2)
        t_start = time.time() - t0
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        prompt = [[5, 6, 7, 8, 9]]
        before = client.generate(prompt, greedy)[0].output_token_logprobs
        tensors = [(n, t.to("cuda:0", torch.bfloat16)) for n, t in read_hf_tensors(ckpt_b).items()]
        num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        with WeightUpdater([client], backend="nccl") as updater:
            torch.cuda.synchronize()
            t1 = time.time()
            updater.update(iter(tensors), weight_version="1")
            t_sync = time.time() - t1
        version = client.get_weight_version()
        after = client.generate(prompt, greedy)[0].output_token_logprobs
        msg = (
            f"server up in {t_start:.0f} s; pushed {num_bytes / 2**20:.1f} MiB in "
            f"{t_sync * 1e3:.0f} ms; weight_version {version!r}; greedy log-probs changed: "
            f"{before != after}"
        )
        if version != "1" or before == after:
            raise AssertionError(msg)
        return msg
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main() -> int:
    """Run the checks; returns the exit status (see the module docstring)."""
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device; the GPU checks (TE vs local logits, bf16 R3 step, NCCL sync)")
        return 0
    from conftest import make_tiny_checkpoint

    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed

    print(f"device: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}")
    init_distributed(ParallelConfig(), seed=1234)
    work = Path(tempfile.mkdtemp(prefix="megatron_sat_gpu_"))
    ckpt_a = make_tiny_checkpoint(work / "a", seed=0, **MODEL)
    ckpt_b = make_tiny_checkpoint(work / "b", seed=1, **MODEL)
    hf = json.loads((ckpt_a / "config.json").read_text())
    results = {}
    checks = {
        "te_vs_local_logits": lambda: check_te_vs_local(hf, ckpt_a),
        "bf16_train_step_r3": lambda: check_bf16_step_r3(hf, ckpt_a),
        "nccl_weight_sync": lambda: check_nccl_weight_sync(ckpt_a, ckpt_b, work),
    }
    for name, check in checks.items():
        t0 = time.time()
        try:
            msg = check()
            status = "SKIP" if msg.startswith("SKIP") else "PASS"
        except Exception as e:  # report every check, then fail at the end
            msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            status = "FAIL"
        results[name] = status
        print(f"{status} {name} ({time.time() - t0:.1f} s): {msg}", flush=True)
    print("summary:", json.dumps(results))
    return 1 if "FAIL" in results.values() else 0


if __name__ == "__main__":
    sys.exit(main())
