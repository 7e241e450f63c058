"""Envs in env processes (``--isolated``): the loop inside one env process and its frames,
the pool of processes in front, and a stream's envs spread over them."""
