"""Data sets and the batch order: offline image data built by name, and which items every step reads.

Layering: a building block. It may import ``dimuon.io``; it must not import ``dimuon.dit``,
``dimuon.metrics``, ``dimuon.optim`` or the commands (``train``, ``eval``, ``bench``), so the model,
the metrics and the training harness all depend on the data, never the other way round.
"""

from dimuon.data.batches import BatchSchedule
from dimuon.data.datasets import (
    DATASETS,
    ArrayDataset,
    DataSpec,
    ImageFolderDataset,
    build_dataset,
    check_image_shape,
    get_batch,
    load_arrays,
    split_indices,
)

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "BatchSchedule",
    "DataSpec",
    "ImageFolderDataset",
    "build_dataset",
    "check_image_shape",
    "get_batch",
    "load_arrays",
    "split_indices",
]
