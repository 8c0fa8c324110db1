"""`python -m arcjax.generate`: see `arcjax.entrypoints.generate`."""

from arcjax.entrypoints.generate import run

if __name__ == "__main__":
    run()
