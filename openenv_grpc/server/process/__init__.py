"""What the whole server process shares: admission (the limiter), the byte budget and
its outsiders' share, auth, deadlines of unary calls, metrics and Info's counters, logs,
forked workers, TLS, the heap trimmer and the orphan reaper. Imports no other room."""
