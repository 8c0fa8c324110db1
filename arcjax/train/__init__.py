"""Training the packaged default model. Needs the `train` extra (optax); the engine core
never imports this package."""
