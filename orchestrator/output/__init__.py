"""What a job leaves and shows: the run directory, Ray metrics, tracking, the control plane's cost."""
