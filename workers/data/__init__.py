"""A step's data: deterministic shards, batches gathered by index, the first batch read ahead."""
