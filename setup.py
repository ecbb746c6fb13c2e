"""megatron-sat: staleness-adaptive trust regions and routing replay for asynchronous MoE RL."""

from setuptools import find_packages, setup

setup(
    name="megatron-sat",
    version="0.1.0",
    description="Asynchronous RL for MoE language models on megatron-core: SAT objectives and R3.",
    packages=find_packages(include=["megatron_sat", "megatron_sat.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch==2.13.0",
        "numpy<2.5",
        "transformers==5.23.0",
        "tokenizers==0.23.3",
        "safetensors==0.8.0",
        "math-verify==0.9.0",
        "tensorboard==2.21.0",
        "matplotlib==3.10.3",
        "tqdm==4.70.1",
        "pyyaml==6.0.3",
        "pyarrow==26.0.1",
        "fastapi==0.163.2",
        "uvicorn==0.54.0",
        "httpx==0.28.1",
        # megatron-core==0.19.2 is installed by tools/bootstrap.sh with --ignore-requires-python
        # (its metadata asks for Python 3.12; it runs on 3.11).
    ],
    extras_require={
        "test": ["pytest==9.2.0", "ruff==0.17.5"],
        "gpu": ["transformer-engine[pytorch]==2.20.2", "sglang==0.5.23"],
    },
    entry_points={"console_scripts": ["megatron-sat=megatron_sat.cli:main"]},
)
