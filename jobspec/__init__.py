"""What the driver and the workers agree on, beneath both: the job's schema (``fields``,
``recipe``, ``runtime``, ``chaos``, ``stragglers``, ``job``), the messages and failures that
cross the actor boundary (``wire``, ``failures``), user code named by import path
(``targets``), secret redaction (``redaction``) and durable files (``durable``).

Imports only ``policies`` beneath it; no Ray, and torch in none of its modules."""
