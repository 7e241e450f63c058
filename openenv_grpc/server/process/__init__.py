"""What the whole server process shares: admission, byte budgets, auth, unary deadlines,
metrics, logs, workers, TLS, heap trimming and orphan reaping. Imports no other room."""
