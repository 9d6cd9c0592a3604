"""Checkpoint files: storage (local or cloud), manifests, tensor files, parts written and read back."""
