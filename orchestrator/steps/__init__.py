"""The step loop's parts: the pipeline of batches in flight, the job's states, straggler control."""
