"""dimuon's optimizers: Muon, Periodic Row-wise Muon, MuonBP and Adaptive Row-wise Muon on one core, plus
grouping and build.

The product. It imports torch only, nothing else of dimuon, so a training script can use it alone.
"""

from dimuon.optim.build import OPTIMIZERS, build
from dimuon.optim.core import FlattenedParameterWarning, ForeignGroupKeyWarning, MuonFamily
from dimuon.optim.distributed.engine import DEFAULT_BUCKET_MB
from dimuon.optim.gradients import NoGradientWarning
from dimuon.optim.grouping import DIT_FUSED_SPLITS, default_algorithm, describe_groups, param_groups
from dimuon.optim.heads import HeadSplits, dit_per_head_splits, per_head_splits
from dimuon.optim.muon import AdaptiveRowMuon, Muon, MuonBP, PeriodicRowMuon
from dimuon.optim.schedules import StepKind

__all__ = [
    "DEFAULT_BUCKET_MB",
    "DIT_FUSED_SPLITS",
    "OPTIMIZERS",
    "AdaptiveRowMuon",
    "FlattenedParameterWarning",
    "ForeignGroupKeyWarning",
    "HeadSplits",
    "Muon",
    "MuonBP",
    "MuonFamily",
    "NoGradientWarning",
    "PeriodicRowMuon",
    "StepKind",
    "build",
    "default_algorithm",
    "describe_groups",
    "dit_per_head_splits",
    "param_groups",
    "per_head_splits",
]
