"""The ``parallel`` section of the run config: the trainer's Megatron parallel layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel layout of the trainer ranks.

    Attributes:
        tensor_model_parallel_size: TP degree (sequence parallel is on whenever TP > 1).
        pipeline_model_parallel_size: PP degree.
        expert_model_parallel_size: EP degree.
        expert_tensor_parallel_size: TP degree inside the experts. 1 (every expert whole on
            one rank, the usual MoE layout and the launch plan's) unless set; megatron-core's
            own default would be the TP size.
        context_parallel_size: CP degree. Only 1 runs today: the launch plan, ``train``'s
            checks and the trainer refuse CP > 1, because the steps do not cut micro-batches
            over CP ranks yet (the load-balanced slicing and the log-prob gather exist:
            ``training.context_parallel``).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name, value in self.sizes().items():
            if value < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {value}")
        if self.context_parallel_size < 1:
            raise ValueError(
                f"parallel.context_parallel_size must be >= 1, got {self.context_parallel_size}"
            )

    def sizes(self) -> dict[str, int]:
        """The four sizes by field name (also the ``transformer_config_from_hf`` keywords)."""
        return {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
        }
