"""Trains the packaged default model (a small Llama) on the Python standard library.

  python scripts/train.py --out_dir=runs/default_model --export_dir=arcjax/default_model

Every TrainConfig field is a flag of the same name; rerunning with the same --out_dir resumes
from its latest checkpoint. See arcjax/train/training.py for the corpus, split and data order.
"""

from __future__ import annotations

import os
import sys

from absl import app, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arcjax.entrypoints.flags import config_from_flags, define_flags  # noqa: E402
from arcjax.train.training import TrainConfig, train  # noqa: E402


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    train(config_from_flags(TrainConfig))


if __name__ == "__main__":
    define_flags(TrainConfig)
    app.run(main)
