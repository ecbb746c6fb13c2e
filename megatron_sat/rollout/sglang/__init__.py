"""SGLang as a rollout engine: its server command (the client is ``rollout.client``)."""
