"""Benchmarks: ringleader side by side with its peers, on the same jobs, in one run."""
