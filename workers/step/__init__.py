"""One training step on a worker: passes, claims, census, rescue, records, verdict, report, plans."""
