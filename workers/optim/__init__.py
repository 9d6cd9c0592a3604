"""Optimizers over flat parameters (fused) or any torch optimizer (generic), their state, loss scaling."""
