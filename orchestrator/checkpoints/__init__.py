"""Coordinated checkpoints, the driver's side: the coordinator, resuming, the namespace and its lease."""
