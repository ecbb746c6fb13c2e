"""vLLM as a rollout engine: client, weight push, server launch, and our gloo weight-transfer
backend (``gloo_engine``, loaded by vLLM inside its workers, never imported by the trainer)."""
