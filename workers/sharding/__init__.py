"""Optimizer state and gradients sharded over a replica group: the slice's optimizer and collectives."""
