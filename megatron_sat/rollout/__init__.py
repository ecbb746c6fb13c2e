"""Rollout: sample records, the SGLang HTTP client, the rollout pool and the embedded CPU server."""
