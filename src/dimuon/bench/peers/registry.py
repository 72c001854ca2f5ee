"""The Muon packages a user can ``pip install`` instead of dimuon, built over the parameters dimuon's Muon gets.

Each :class:`Peer` says how to build that package's optimizer on the hidden matrices that
:func:`dimuon.optim.param_groups` sends to Muon (the rest goes to AdamW, the peer's own where it has
one, ``torch.optim.AdamW`` beside it otherwise), with dimuon's defaults where the peer lets them be
set: momentum 0.95 with Nesterov, 5 Newton-Schulz steps, no weight decay, AdamW betas (0.9, 0.95)
and eps 1e-8. It also records what was read in the package's source: the dtype its Newton-Schulz
computes in, and how it treats sharded (DTensor) parameters. :func:`probe` says whether a peer can
run in a setting here, and why not. Nothing here is needed by dimuon itself or by its tests.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dimuon.optim import build, param_groups

Setting = Literal["local", "fsdp2", "hsdp", "tp"]
SETTING_WORDS = {
    "local": "in one process",
    "fsdp2": "under FSDP2",
    "hsdp": "under HSDP (replicate x shard mesh)",
    "tp": "with tensor-parallel (Shard(0) and Shard(1)) weights",
}
INSTALL_HINT = "pip install 'dimuon[peers]'"
MOMENTUM, NS_STEPS = 0.95, 5
ADAMW_BETAS, ADAMW_EPS = (0.9, 0.95), 1e-8


def muon_and_rest(model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """Matrices that ``param_groups`` sends to Muon, and every other trainable parameter."""
    muon, rest = [], []
    for group in param_groups(model):
        for _, p in group["params"]:
            (muon if group["algorithm"] == "muon" and p.ndim == 2 else rest).append(p)
    return muon, rest


class Paired:
    """A peer's Muon on the matrices and an AdamW on the rest, stepped together as one optimizer."""

    def __init__(self, main: Any, aux: torch.optim.Optimizer) -> None:
        self.main, self.aux = main, aux

    def step(self) -> None:
        self.main.step()
        self.aux.step()


def adamw_for_rest(rest: Sequence[Tensor], lr: float) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with the hyperparameters of dimuon's own AdamW groups (foreach)."""
    return build("adamw", list(rest), lr=lr, foreach=True)


# ------------------------------------------------------------------------------------- adapters


def _build_torch_muon(mod: ModuleType, muon: list[Tensor], rest: list[Tensor], lr: float) -> Any:
    main = mod.Muon(
        muon,
        lr=lr,
        weight_decay=0.0,
        momentum=MOMENTUM,
        nesterov=True,
        ns_steps=NS_STEPS,
        adjust_lr_fn="match_rms_adamw",
    )
    return Paired(main, adamw_for_rest(rest, lr))


def _build_muon_fsdp2(mod: ModuleType, muon: list[Tensor], rest: list[Tensor], lr: float) -> Any:
    # Its own Adam for the groups with use_muon=False; rms_scale=True is its RMS-matched lr scale.
    return mod.Muon(
        [
            {
                "params": muon,
                "use_muon": True,
                "lr": lr,
                "momentum": MOMENTUM,
                "nesterov": True,
                "weight_decay": 0.0,
                "rms_scale": True,
                "ns_steps": NS_STEPS,
            },
            {"params": rest, "use_muon": False, "lr": lr, "betas": ADAMW_BETAS, "eps": ADAMW_EPS, "weight_decay": 0.0},
        ]
    )


def _build_dtensor_muon(mod: ModuleType, muon: list[Tensor], rest: list[Tensor], lr: float) -> Any:
    # One optimizer, groups tagged by "algorithm"; quintic Newton-Schulz like dimuon's default.
    return mod.Muon(
        [{"params": muon}, {"params": rest, "algorithm": "adamw"}],
        lr=lr,
        wd=0.0,
        use_cautious_wd=False,
        momentum=MOMENTUM,
        nesterov=True,
        ns_steps=NS_STEPS,
        orthogonalization_strategy="newton_schulz",
        adam_betas=ADAMW_BETAS,
        adam_eps=ADAMW_EPS,
    )


def _build_heavyball(mod: ModuleType, muon: list[Tensor], rest: list[Tensor], lr: float) -> Any:
    # SplitOpt routes the matrices to its Muon (momentum = betas[0]) and the rest to its AdamW.
    # consume_grad=False: by default it sets p.grad = None after reading it.
    return mod.SplitOpt(
        [
            {
                "params": muon,
                "optimizer": mod.Muon,
                "lr": lr,
                "betas": (MOMENTUM, 0.99),
                "nesterov": True,
                "weight_decay": 0.0,
                "consume_grad": False,
            },
            {
                "params": rest,
                "optimizer": mod.AdamW,
                "lr": lr,
                "betas": ADAMW_BETAS,
                "eps": ADAMW_EPS,
                "weight_decay": 0.0,
                "consume_grad": False,
            },
        ]
    )


@dataclass(frozen=True)
class Peer:
    """One installable Muon implementation and what its source says about it."""

    key: str
    label: str
    distribution: str  # the pip name (its version is recorded)
    module: str  # what to import
    ns_dtype: str  # the dtype its Newton-Schulz computes in, whatever the parameters' dtype
    ns_source: str  # where that is decided
    sharded: str  # how it treats DTensor (FSDP2) parameters
    builder: Callable[[ModuleType, list[Tensor], list[Tensor], float], Any]
    read_version: str  # the version whose source the fields above and below describe
    needs_cuda: str | None = None  # why it cannot run on a CPU, if it cannot
    unsupported: dict[str, str] = field(default_factory=dict)  # setting -> why not (at read_version)


PEERS: dict[str, Peer] = {
    "torch_muon": Peer(
        "torch_muon",
        "torch.optim.Muon + AdamW",
        "torch",
        "torch.optim",
        "bfloat16",
        "hard-coded: grad.bfloat16() before the iteration",
        "DTensor ops: sharding propagation gathers and reduces as each product needs (whole-matrix Muon)",
        _build_torch_muon,
        "2.13.0",
    ),
    "muon_fsdp2": Peer(
        "muon_fsdp2",
        "muon-fsdp2 Muon (+ its Adam)",
        "muon-fsdp2",
        "muon_fsdp2",
        "bfloat16",
        "hard-coded: G.bfloat16(), iteration under torch.compile",
        "1-D DTensor mesh: each matrix's shards gathered along dim 0 to one owner rank, orthogonalized there, "
        "scattered back; on a 2-D (HSDP) mesh its step fails (NotImplementedError here; its code asserts a 1-D mesh)",
        _build_muon_fsdp2,
        "0.3.0",
        unsupported={
            "local": "its single-process path (SingelDeviceWork) calls muon_update, which the module "
            "does not define (NameError)",
            "tp": "it joins the gathered shards along dim 0 whatever their placement, so a Shard(1) "
            "(column-split) weight would be orthogonalized as a different matrix; not run",
        },
    ),
    "dtensor_muon": Peer(
        "dtensor_muon",
        "dtensor-muon Muon (+ its AdamW)",
        "dtensor-muon",
        "dtensor_muon",
        "bfloat16",
        "hard-coded: G.bfloat16(), Triton Gram kernel under torch.compile",
        "DTensor: full_tensor() of each matrix, every rank orthogonalizes it, redistributed back",
        _build_dtensor_muon,
        "0.1.0",
        needs_cuda="its Newton-Schulz runs a Triton Gram kernel on CUDA tensors only (gram_ asserts is_cuda)",
    ),
    "heavyball": Peer(
        "heavyball",
        "heavyball Muon (+ its AdamW, SplitOpt)",
        "heavyball",
        "heavyball",
        "bfloat16",
        "hard-coded: stochastic rounding to bf16 before the iteration, under torch.compile",
        "DTensor: full_tensor() of update, gradient and parameter of each matrix, every rank orthogonalizes it",
        _build_heavyball,
        "3.2.1",
    ),
}


@dataclass(frozen=True)
class PeerStatus:
    """What a benchmark records about a peer in one setting: identity, version, NS dtype, and whether it ran."""

    key: str
    label: str
    package: str
    version: str | None
    ns_dtype: str
    ns_source: str
    sharded: str
    read_version: str
    runnable: bool
    reason: str | None = None  # "cannot run here: ..." when not runnable

    def failed(self, why: str) -> PeerStatus:
        """The same peer, marked as unable to run, with ``why``."""
        return PeerStatus(**{**asdict(self), "runnable": False, "reason": f"cannot run here: {why}"})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_names(names: Sequence[str], flag: str = "--peers") -> None:
    """A clear error for a peer name that is not in :data:`PEERS`."""
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"{flag} got unknown peer(s) {unknown}; choose from {list(PEERS)}")


def installed_version(distribution: str) -> str | None:
    """The installed version of a pip distribution, None when it is not installed; torch's with its build tag
    (``2.11.0+cu130``: a CUDA wheel's metadata leaves the tag out, and the build is what a timing depends on)."""
    if distribution == "torch":
        return torch.__version__
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(peer: Peer) -> ModuleType:
    return importlib.import_module(peer.module)


def probe(key: str, device: torch.device | str = "cpu", setting: Setting = "local") -> PeerStatus:
    """Whether peer ``key`` can run on ``device`` in ``setting`` (``local``: one process, plain tensors;
    ``fsdp2``: DTensor parameters sharded on a 1-D mesh; ``hsdp``: replicated x sharded on a 2-D mesh; ``tp``:
    tensor-parallel weights, with or without FSDP) here: installed, importable, supported."""
    peer = PEERS[key]
    version = installed_version(peer.distribution)
    status = PeerStatus(
        peer.key,
        peer.label,
        peer.distribution,
        version,
        peer.ns_dtype,
        peer.ns_source,
        peer.sharded,
        peer.read_version,
        runnable=True,
    )
    if version is None:
        return status.failed(f"{peer.distribution} is not installed ({INSTALL_HINT})")
    try:
        _import(peer)
    except Exception as err:  # a peer that fails to import for any reason is a row, not a crash
        return status.failed(f"import {peer.module} fails: {type(err).__name__}: {err}")
    if peer.needs_cuda and torch.device(device).type != "cuda":
        return status.failed(f"needs a CUDA device: {peer.needs_cuda}")
    if setting in peer.unsupported and version.split("+")[0] == peer.read_version:
        return status.failed(f"{SETTING_WORDS[setting]}: {peer.unsupported[setting]}")
    return status


def build_peer(key: str, muon: list[Tensor], rest: list[Tensor], lr: float) -> Any:
    """Peer ``key``'s optimizer over ``muon`` (the hidden matrices) and ``rest`` (AdamW); has ``step()``."""
    peer = PEERS[key]
    return peer.builder(_import(peer), muon, rest, lr)
