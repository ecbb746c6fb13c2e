"""Hugging Face <-> megatron-core name maps, safetensors I/O, run checkpoints."""
