"""A discrete-event simulator of a data-parallel job on thousands of workers, driving the same
policy classes the real jobs run (``ringleader simulate``; docs/architecture.md, "The
simulator")."""
