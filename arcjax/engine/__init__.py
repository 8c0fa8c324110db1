"""The engine core: the step loop, per-request state, outputs, trace, config and build."""
