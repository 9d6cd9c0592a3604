"""The commands beside ``run``: submit, tune, plan (memory), report."""
