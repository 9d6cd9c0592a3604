"""The Ray driver: job config, worker group, control loop, run directory, CLI."""
