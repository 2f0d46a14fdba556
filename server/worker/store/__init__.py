"""What a worker writes and reads back: the store writer (its own process) and the feature tier (L2)."""
