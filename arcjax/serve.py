"""`python -m arcjax.serve [MODEL_DIR] [--flags]`: see `arcjax.entrypoints.openai.api_server` and
`arcjax.entrypoints.cli` (`arcjax serve` is the same command)."""

from arcjax.entrypoints.cli import serve_main

if __name__ == "__main__":
    serve_main()
