"""megatron-sat: asynchronous RL for MoE models with SAT objectives and R3 routing replay."""
