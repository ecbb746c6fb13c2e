"""Embedded rollout server: a CPU transformers model behind SGLang's HTTP API."""
