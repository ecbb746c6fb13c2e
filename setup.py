"""megatron-sat: staleness-adaptive trust regions and routing replay for asynchronous MoE RL.

The package declares the version RANGES it supports, so that it installs into an existing
environment (an NGC container's or a cluster's CUDA torch). The exact pins of the tested CPU
environment live in tools/requirements-cpu.txt, which tools/bootstrap.sh installs. SGLang and
vLLM are rollout servers with their own environments and pins (tools/vllm_env.sh, the launch
scripts): they are never resolved together with the trainer, so they are no extra here.
tests/test_packaging.py runs a resolver over this metadata for the base and every extra.
"""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    # Any CUDA or CPU build from 2.6 on (the CPU shims of megatron_sat.platform were measured
    # on 2.13.0; the GPU device image brings 2.11).
    "torch>=2.6",
    "numpy>=1.26,<2.5",
    "transformers>=5.19,<6",
    "tokenizers>=0.22,<0.24",
    "safetensors>=0.5",
    "math-verify>=0.8,<0.10",
    "tensorboard>=2.18",
    "matplotlib>=3.9",
    "tqdm>=4.66",
    "pyyaml>=6.0",
    "pyarrow>=18",
    "fastapi>=0.115",
    "uvicorn>=0.30",
    "httpx>=0.27,<0.29",
    # The rollout data path: SIMD validating base64 of the routes, reply bodies without
    # copying them through a Python str (megatron_sat.routing.payload, routing.wire).
    "pybase64>=1.4,<2",
    "orjson>=3.10,<4",
    # megatron-core's metadata asks for Python 3.12; on 3.11 tools/bootstrap.sh installs the
    # pinned 0.19.2 with --ignore-requires-python (it runs on 3.11), and docs/gpu.md names it
    # on the command line with that flag for a GPU environment on 3.11.
    'megatron-core>=0.19.2,<0.20; python_version >= "3.12"',
]

EXTRAS_REQUIRE = {
    "test": ["pytest>=8.3", "ruff>=0.17,<0.18"],
    # The trainer's GPU extra only: transformer-engine into the existing CUDA torch. Its torch
    # extension is a source package compiled against the torch it finds, so install this extra
    # with --no-build-isolation (docs/gpu.md); apex is built from source there too (the PyPI
    # project named apex is another one). Both are optional: platform/fusions.py turns each
    # fusion on only when its module imports.
    "gpu": ["transformer-engine[pytorch]>=2.6"],
    # Experiment tracking beside TensorBoard (logging.wandb_project; training/trackers.py).
    "wandb": ["wandb>=0.19"],
    # logging.mlflow_experiment: MLflow's client only (mlflow-skinny: no server, UI or ML
    # frameworks; about 85 MB with its dependencies beside ours).
    "mlflow": ["mlflow-skinny>=3.1"],
}

setup(
    name="megatron-sat",
    version="0.1.0",
    description="Asynchronous RL for MoE language models on megatron-core: SAT objectives and R3.",
    packages=find_packages(include=["megatron_sat", "megatron_sat.*"]),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["megatron-sat=megatron_sat.cli:main"]},
)
