"""What an env is to the server, with no I/O: what is read off its class (spec), the
phase machine and its words, payload checks, the per-env queries, snapshot sealing and
where a call runs (placement)."""
