"""Distributed input: datasets split across replicas as tf.distribute splits them, fed ahead.

`datasets` is the public face (`DistributedDataset`, its iterator); `batches` splits global
batches by TF's rule and places them; `numpy_dataset` and `tf_shuffle` reproduce tf.data's
verbs and shuffle order; `prefetch`, `blocks` and `in_place` keep the devices fed. The core
reaches this wing only through `base.InputWing`.
"""
