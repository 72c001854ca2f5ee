"""Data sets and the batch order: offline image data built by name, which items every step reads, and a
check that every item can be used (before a run starts rather than when a step draws it).

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
    infer_num_classes,
    load_arrays,
    split_indices,
)
from dimuon.data.subsets import BALANCED_SUBSET, balanced_subset
from dimuon.data.validation import DataError, describe_item, find_problems, problems_message

__all__ = [
    "BALANCED_SUBSET",
    "DATASETS",
    "ArrayDataset",
    "BatchSchedule",
    "DataError",
    "DataSpec",
    "ImageFolderDataset",
    "balanced_subset",
    "build_dataset",
    "check_image_shape",
    "describe_item",
    "find_problems",
    "get_batch",
    "infer_num_classes",
    "load_arrays",
    "problems_message",
    "split_indices",
]
