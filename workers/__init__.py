"""The worker side: model replica, deterministic shards, collectives, telemetry."""
