"""What committed steps add up to: the commit ledger, their sinks, recoveries, the summary."""
