"""Envs in this process: the batch of a stream's envs (a loop of plain instances, or the
env's native batch), the runner that calls env code inline, on a thread or on the loop,
its threads, the calls a driver makes, and a batch's outcome in the wire's columns."""
