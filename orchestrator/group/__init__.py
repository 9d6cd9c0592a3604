"""The worker group: its interface, the Ray implementation, membership, slots, starts, chaos."""
