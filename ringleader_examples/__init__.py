"""Example models and datasets that ship with ringleader (no downloads)."""
