"""`python -m arcjax.generate`: see `arcjax.entrypoints.generate_cli`."""

from arcjax.entrypoints.generate_cli import run

if __name__ == "__main__":
    run()
