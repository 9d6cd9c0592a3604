"""Pure decision logic: telemetry in, a small frozen decision out. No Ray or torch imports."""
