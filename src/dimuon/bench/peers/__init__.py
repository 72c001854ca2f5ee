"""Peers side by side: other installable Muon packages as benchmark rows, and one way to count everyone's bytes.

- :mod:`~dimuon.bench.peers.registry`: each peer, how it is built over dimuon's parameter split, its
  version, Newton-Schulz dtype, sharded support, and why it cannot run where it cannot.
- :mod:`~dimuon.bench.peers.boundary`: :func:`count_collectives`, logical bytes per rank counted at
  the ``torch.distributed`` call boundary, for dimuon's optimizers and the peers alike.
- :mod:`~dimuon.bench.peers.harness`: same gradients every step, a first step that may fail.
"""

from dimuon.bench.peers.boundary import CallCounter, CallRecord, count_collectives, fold_kinds
from dimuon.bench.peers.harness import GradientSnapshot, bf16_note, first_step, start_peer
from dimuon.bench.peers.registry import (
    INSTALL_HINT,
    PEERS,
    Peer,
    PeerStatus,
    build_peer,
    check_names,
    muon_and_rest,
    probe,
)

__all__ = [
    "INSTALL_HINT",
    "PEERS",
    "CallCounter",
    "CallRecord",
    "GradientSnapshot",
    "Peer",
    "PeerStatus",
    "bf16_note",
    "build_peer",
    "check_names",
    "count_collectives",
    "first_step",
    "fold_kinds",
    "muon_and_rest",
    "probe",
    "start_peer",
]
