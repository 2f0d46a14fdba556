"""Pure pieces the frontends and the workers both load: the status-code table, normalization, the model
repository, answers and their records, admission arithmetic, head scoring, feature keys, tokenization,
auth, framing of the worker connection, telemetry, and process setup."""
