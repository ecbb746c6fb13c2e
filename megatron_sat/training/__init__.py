"""Trainer side of megatron-sat: the train loop, batching, log-probs, and run logging."""
