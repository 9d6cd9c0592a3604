"""The model side of a pass: objective, flat parameters, buffers, seeding, precision, evaluation."""
