"""Distributed input: datasets split across replicas as tf.distribute splits them, fed ahead.

`datasets` is the public face (`DistributedDataset`, its iterator); `batches` splits global
batches by TF's rule and places them; `numpy_dataset` and `tf_shuffle` reproduce tf.data's
verbs and shuffle order; `prefetch`, `blocks` and `in_place` keep the devices fed. The core
reaches this wing only through `base.InputWing`.
"""

import sys

from jdist._src import base
from jdist._src.input.datasets import distribute_dataset
from jdist._src.input.datasets import distribute_datasets_from_function
from jdist._src.input.datasets import make_numpy_dataset

__all__ = ["distribute_dataset", "distribute_datasets_from_function", "make_numpy_dataset"]

base.register_wing("input", sys.modules[__name__])  # As `base.InputWing`.
