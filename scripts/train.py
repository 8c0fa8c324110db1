"""Trains the packaged default model (a small Llama) on the Python standard library.

  python scripts/train.py --out_dir=runs/default_model --export_dir=arcjax/default_model

Every TrainConfig field is a flag of the same name; rerunning with the same --out_dir resumes
from its latest checkpoint. See arcjax/training.py for the corpus, split and data order.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arcjax.train.training import TrainConfig, train  # noqa: E402

_DEFINE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
           str: flags.DEFINE_string}
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
for _f in dataclasses.fields(TrainConfig):
    _DEFINE[_TYPES[_f.type]](_f.name, _f.default, f"TrainConfig.{_f.name}")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    cfg = TrainConfig(**{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(TrainConfig)})
    train(cfg)


if __name__ == "__main__":
    app.run(main)
