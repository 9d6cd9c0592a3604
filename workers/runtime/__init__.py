"""What a worker process runs on: its device, waits an abort can end, injected faults."""
