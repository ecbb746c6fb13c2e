"""vLLM general plugin: registers megatron-sat's gloo weight-transfer backend.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes before it
builds the engine; the backend's module is imported only when a server selects it
(``--weight-transfer-config '{"backend": "megatron_sat_gloo"}'``).
"""


def register() -> None:
    """Register ``megatron_sat_gloo`` with vLLM's weight-transfer factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if "megatron_sat_gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "megatron_sat_gloo",
            "megatron_sat.rollout.vllm.gloo_engine",
            "GlooWeightTransferEngine",
        )
