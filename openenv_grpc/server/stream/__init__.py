"""One stream, whatever its wire: its lifecycle (admission to close), the one stream loop,
the wires (gRPC's context, an in-process stream), the driver that owns its envs' episodes,
and the two views that turn a Session's or a VectorSession's requests into driver calls."""
