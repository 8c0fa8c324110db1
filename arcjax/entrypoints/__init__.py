"""What users run: `LLM`, the `generate` command (and the server beside them)."""
