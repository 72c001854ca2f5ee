"""The typed configuration of ``dimuon train``: dataclasses parsed by tyro, checked before any work starts.

Every field is a command-line flag (``batch_size`` is ``--batch-size``, ``optim.k`` is ``--optim.k``);
unknown flags are rejected by the parser. ``validate`` raises :class:`ConfigError` naming the flag and
the allowed values, so a bad run fails in the first second instead of after the model is built;
``dimuon.train.plan.resolve`` then turns the checked flags into the parts a run needs. The
``--optim.*`` group is derived from the optimizers' signatures (``dimuon.train.optim_options``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from dimuon.data import DATASETS
from dimuon.dit import DIT_MODELS, dit_arch
from dimuon.dit.parallel import Parallelism
from dimuon.io import to_json
from dimuon.metrics.eval_settings import EvalSettings, check_eval_settings
from dimuon.metrics.series import check_device
from dimuon.optim import OPTIMIZERS
from dimuon.optim.build import ONE_PROCESS_ONLY
from dimuon.train.optim_options import OPTION_SPECS, OptimOptions, accepted_parameters, options_from_dict

__all__ = [
    "FROZEN_ON_RESUME",
    "FROZEN_OPTIM_ON_RESUME",
    "RESUME_AUTO",
    "ConfigError",
    "EvalOptions",
    "OptimOptions",
    "ParallelOptions",
    "TrainConfig",
    "changed_on_resume",
    "check_patch_size",
    "check_resume_flags",
    "check_token_split",
    "config_from_dict",
    "config_to_dict",
    "parallelism",
    "validate",
]

RESUME_AUTO = "auto"  # --resume auto: continue the run in --out if it has one, else start it
TrainDevice = Literal["auto", "cpu", "cuda"]  # --device: every rank takes its own GPU (cuda:LOCAL_RANK) under cuda
TRAIN_DEVICES: tuple[str, ...] = get_args(TrainDevice)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the flag and what is allowed."""


@dataclass
class ParallelOptions:
    """Parallelism degrees in torchtitan's style; dp_replicate x dp_shard x cp x tp is the world size.

    dp_shard alone is FSDP2; dp_replicate x dp_shard is HSDP (e.g. one replica per node, sharded within
    it); tp splits attention heads and MLP units over ranks (docs/training.md, "Parallelism"); dp_shard x tp
    is FSDP over tensor parallelism; all three is HSDP over tensor parallelism (a 3-D mesh); cp splits every
    image's tokens over ranks that share the same samples, with FSDP over dp_shard x cp.
    """

    dp_replicate: int = 1
    """Data-parallel replicas of the (sharded) model (HSDP)."""
    dp_shard: int = -1
    """Ranks each replica's parameters are sharded over (FSDP2); -1: what the other degrees leave of the world."""
    tp: int = 1
    """Tensor-parallel degree: must divide the attention heads and the MLP hidden units."""
    cp: int = 1
    """Context-parallel degree: ranks that train on the same samples, each on a contiguous chunk of every image's
    tokens; must divide the tokens per image ((image size / patch size)**2)."""


@dataclass
class EvalOptions(EvalSettings):
    """Generation quality during training: the flags of 'dimuon eval', plus how often.

    Results go to <out>/eval/ (one series with 'dimuon eval' under equal flags, so it skips these
    steps) and to metrics.jsonl as gen_eval records.
    """

    interval: int = 0
    """Steps between evaluations, and one at the last step (0: no evaluation during training)."""


@dataclass
class TrainConfig:
    """Train a class-conditional DiT with rectified flow. The defaults are the CPU MNIST demo."""

    # --- model and data
    model: str = "DiT-XS/4"
    """DiT registry name: DiT-{T,XS}/{2,4}, DiT-{S,B,L,XL}/{2,4,8}."""
    dataset: str = "mnist"
    """mnist | digits | folder (needs --data-path) | arrays (needs --data-path)."""
    data_path: str | None = None
    """Root folder (folder) or file/folder of arrays (arrays)."""
    image_size: int | None = None
    """Image side in pixels; default: the data set's own (28 for mnist). Required for folder."""
    channels: int | None = None
    """folder only: 1 (grayscale) or 3 (RGB, the default)."""
    num_classes: int | None = None
    """arrays only: the number of classes (default: the number K of distinct labels, which must be 0..K-1)."""
    class_dropout: float = 0.1
    """Probability of replacing a label by the null label (needed for classifier-free guidance)."""

    # --- optimization
    optimizer: str = "periodic_row_muon"
    """adamw | muon | periodic_row_muon | muon_bp | adaptive_row_muon | torch_muon (torch.optim.Muon + AdamW,
    one process)."""
    optim: OptimOptions = field(default_factory=OptimOptions)
    lr: float = 1e-2
    """Peak learning rate (shared by the Muon and AdamW groups of the Muon family)."""
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    """Learning-rate shape after warmup: cosine or linear decay to lr * min_lr_ratio, or constant."""
    warmup_steps: int = 50
    """Linear warmup from lr / warmup_steps to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine/linear schedule, as a fraction of lr."""
    batch_size: int = 32
    """Global batch size (split evenly over ranks)."""
    steps: int = 1000
    """Optimizer steps."""
    seed: int = 0
    """Seeds the initialization, the data order and the training noise."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    timesteps: Literal["uniform", "logit_normal"] = "logit_normal"
    """Training distribution of the flow time t."""
    ema_decay: float = 0.995
    """EMA decay of the weights used for validation samples and evaluation."""
    ema_warmup: bool = True
    """Ramp the EMA decay as min(decay, (1 + k) / (10 + k)) so early averages forget the init."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16 runs forward/backward under autocast and, under FSDP2, all-gathers the parameters in bf16 with fp32
    gradient reductions (MixedPrecisionPolicy); parameters and optimizer state stay fp32."""
    nonfinite: Literal["raise", "skip"] = "raise"
    """A step whose loss or gradient norm is NaN/inf, with any optimizer: raise stops the run with an error
    naming the step (and the data, where known); skip drops the step (weights, optimizer and EMA unchanged)
    and counts it in the log."""
    skip_limit: int = 10
    """With --nonfinite skip: this many skipped steps in a row stop the run as diverged (0: never)."""

    # --- logging, validation, sampling, checkpoints
    log_interval: int = 10
    """Steps between JSONL training records."""
    val_interval: int = 250
    """Steps between validation losses (0: only at the end)."""
    val_samples: int = 256
    """Held-out images used for the validation loss (0: the whole split)."""
    val_subset: Literal["balanced", "first"] = "balanced"
    """Which --val-samples images: balanced (the classes in turn) or first (the split's first, which in a
    class-ordered split are its first classes; what runs took before this flag existed)."""
    val_seed: int = 0
    """Seed of the fixed validation noise."""
    sample_interval: int = 0
    """Steps between sample grids (0: only at the end)."""
    sample_count: int = 100
    """Images per sample grid (labels cycle through the classes, one class per column)."""
    sample_steps: int = 20
    """ODE steps of the sampler."""
    sample_method: Literal["euler", "heun"] = "heun"
    """ODE method of the sampler."""
    cfg_scale: float = 3.0
    """Classifier-free guidance scale of the sample grids (1 disables guidance)."""
    ckpt_interval: int = 250
    """Steps between checkpoints (0: only at the end; the last step is always saved)."""
    keep_checkpoints: int = 0
    """Checkpoints to keep, newest first (0: keep all)."""
    eval: EvalOptions = field(default_factory=EvalOptions)

    # --- run
    out: str = "runs/mnist-demo"
    """Run directory: config.json, metrics.jsonl, checkpoints/, samples/, plots/."""
    resume: str | None = None
    """Continue from a checkpoint directory, or from the newest complete one of a run directory (a run
    without one restarts from step 0 with its config); --resume with no value: the run in --out. --resume
    auto: the run in --out from its newest checkpoint that passes its manifest, or a new run there if it
    holds none yet (one command for the first launch and every restart of torchrun --max-restarts; a
    directory named auto is ./auto). Flags not given keep the run's saved values; those that fix the model,
    the data or the data order cannot change."""
    overwrite: bool = False
    """Start afresh in an --out that already holds a run (its old files are deleted)."""
    device: TrainDevice = "auto"
    """auto: cuda if available, else cpu."""
    threads: int | None = None
    """CPU intra-op threads per process (default: torch's)."""
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    tensorboard: bool = False
    """Also write TensorBoard events to <out>/tensorboard (needs the tensorboard package)."""
    progress: bool = True
    """Show a progress bar (rank 0)."""


# --------------------------------------------------------------------------------------------------
# Conversions
# --------------------------------------------------------------------------------------------------


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """A JSON-ready dict of the config (tuples become lists)."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Rebuild a config saved by :func:`config_to_dict`; unknown keys are an error, missing ones take defaults."""
    data = dict(data)
    optim = dict(data.pop("optim", {}) or {})
    evals = dict(data.pop("eval", {}) or {})
    if "nonfinite" in optim:  # saved before the policy became the harness's own --nonfinite
        value = optim.pop("nonfinite")
        data.setdefault("nonfinite", value if value is not None else "raise")
    parallel = dict(data.pop("parallel", {}) or {})  # runs of earlier versions have none: FSDP over all ranks
    data.setdefault("val_subset", "first")  # saved before the choice existed: those runs took the first items
    unknown = sorted(
        (set(data) - _field_names(TrainConfig))
        | {f"optim.{k}" for k in set(optim) - _field_names(OptimOptions)}
        | {f"eval.{k}" for k in set(evals) - _field_names(EvalOptions)}
        | {f"parallel.{k}" for k in set(parallel) - _field_names(ParallelOptions)}
    )
    if unknown:
        raise ConfigError(f"saved config has unknown keys {unknown}")
    for key in ("dinov2_weights", "cache_dir"):
        if evals.get(key) is not None:
            evals[key] = Path(evals[key])
    return TrainConfig(
        **data, optim=options_from_dict(optim), eval=EvalOptions(**evals), parallel=ParallelOptions(**parallel)
    )


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choice(flag: str, value: str, allowed: Any) -> None:
    _require(value in allowed, f"{flag} must be one of: {', '.join(allowed)}; got {value!r}")


def _check_positive_int(flag: str, value: int, minimum: int = 1) -> None:
    _require(value >= minimum, f"{flag} must be an integer >= {minimum}, got {value}")


def validate(cfg: TrainConfig) -> None:
    """Raise :class:`ConfigError` for any value that cannot work (cheap checks only: no model, no data)."""
    _check_choice("--model", cfg.model, DIT_MODELS)
    _check_choice("--dataset", cfg.dataset, DATASETS)
    _check_choice("--optimizer", cfg.optimizer, OPTIMIZERS)
    _require(math.isfinite(cfg.lr) and cfg.lr > 0, f"--lr must be a positive number, got {cfg.lr}")
    _check_positive_int("--steps", cfg.steps)
    _check_positive_int("--batch-size", cfg.batch_size)
    _check_positive_int("--warmup-steps", cfg.warmup_steps, 0)
    _require(0.0 <= cfg.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    _require(cfg.grad_clip >= 0, f"--grad-clip must be >= 0 (0 disables clipping), got {cfg.grad_clip}")
    _require(0.0 <= cfg.ema_decay <= 1.0, f"--ema-decay must be in [0, 1], got {cfg.ema_decay}")
    _require(0.0 <= cfg.class_dropout < 1.0, f"--class-dropout must be in [0, 1), got {cfg.class_dropout}")
    _check_positive_int("--skip-limit", cfg.skip_limit, 0)
    # A flag set to what the run would ignore is a mistake in the command, not a choice: say so at start-up. Not on
    # resume, where the value may be the resumed run's own (a run with --nonfinite skip continued under raise).
    unused = (
        ("min_lr_ratio", "--min-lr-ratio", cfg.schedule == "constant", "--schedule constant keeps the lr at --lr"),
        ("skip_limit", "--skip-limit", cfg.nonfinite == "raise", "it counts skipped steps: --nonfinite skip"),
    )
    for name, flag, ignored, why in unused:
        value, default = getattr(cfg, name), TrainConfig.__dataclass_fields__[name].default
        _require(
            not ignored or value == default or bool(cfg.resume), f"{flag} {value} has no effect here ({why}); drop it"
        )
    _check_positive_int("--log-interval", cfg.log_interval)
    for flag, value in (
        ("--seed", cfg.seed),
        ("--val-seed", cfg.val_seed),
    ):  # the seeds derived from them stay in range
        _require(0 <= value < 2**31, f"{flag} must be an integer in [0, 2**31), got {value}")
    for flag, value in (
        ("--val-interval", cfg.val_interval),
        ("--val-samples", cfg.val_samples),
        ("--sample-interval", cfg.sample_interval),
        ("--ckpt-interval", cfg.ckpt_interval),
        ("--keep-checkpoints", cfg.keep_checkpoints),
    ):
        _check_positive_int(flag, value, 0)
    _require(cfg.val_subset in ("balanced", "first"), f"--val-subset must be balanced or first, got {cfg.val_subset!r}")
    _check_positive_int("--sample-count", cfg.sample_count)
    _check_positive_int("--sample-steps", cfg.sample_steps)
    _require(cfg.cfg_scale >= 0, f"--cfg-scale must be >= 0, got {cfg.cfg_scale}")
    if cfg.threads is not None:
        _check_positive_int("--threads", cfg.threads)
    _check_device(cfg.device)
    _require(bool(cfg.out), "--out must name a directory")
    _require(
        not (cfg.resume == RESUME_AUTO and cfg.overwrite),
        "--overwrite cannot go with --resume auto: --resume auto continues the run in --out, which --overwrite "
        "would delete (at every restart); pass one of them",
    )
    _validate_data(cfg)
    _validate_eval(cfg)
    _validate_parallel(cfg)


def _check_device(device: str) -> None:
    """``--device``: one of the names training takes (each rank picks its own GPU, so ``cuda``, not ``cuda:N``),
    and one this machine has, as every command checks it (:func:`dimuon.metrics.series.check_device`)."""
    _check_choice("--device", device, TRAIN_DEVICES)
    try:
        check_device(device, "--device")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_data(cfg: TrainConfig) -> None:
    """Data flags: paths exist where needed, and the image size fits the model's patch size."""
    if cfg.dataset in ("folder", "arrays"):
        _require(cfg.data_path is not None, f"--dataset {cfg.dataset} needs --data-path")
        _require(Path(cfg.data_path).exists(), f"--data-path {cfg.data_path} does not exist")
    else:
        _require(cfg.data_path is None, f"--data-path is not used by --dataset {cfg.dataset}")
    if cfg.dataset == "folder":
        _require(cfg.image_size is not None, "--dataset folder needs --image-size")
    else:
        _require(cfg.channels is None, "--channels only applies to --dataset folder")
    if cfg.num_classes is not None:
        _require(
            cfg.dataset == "arrays",
            f"--num-classes only applies to --dataset arrays (the classes of --dataset {cfg.dataset} are known)",
        )
        _check_positive_int("--num-classes", cfg.num_classes)
    if cfg.image_size is not None:
        _check_positive_int("--image-size", cfg.image_size)
        check_patch_size(cfg.model, cfg.image_size)
        check_token_split(cfg.model, cfg.image_size, cfg.parallel.cp)


def check_patch_size(model: str, image_size: int) -> None:
    """The model cuts images into patches: its patch size must divide the image side."""
    patch = dit_arch(model)["patch_size"]
    _require(
        image_size % patch == 0,
        f"--model {model} has patch size {patch}, which does not divide the image size {image_size}; "
        f"choose a patch size that divides {image_size} or change --image-size",
    )


def check_token_split(model: str, image_size: int, cp: int) -> None:
    """Context parallelism gives every rank of a ``cp`` group an equal chunk of each image's tokens."""
    patch = dit_arch(model)["patch_size"]
    grid = image_size // patch
    tokens = grid * grid
    fits = ", ".join(str(d) for d in range(1, min(tokens, 64) + 1) if tokens % d == 0)
    _require(
        tokens % cp == 0,
        f"--parallel.cp {cp} must divide the {tokens} tokens per image of --model {model} on {image_size}x"
        f"{image_size} images (a {grid} x {grid} grid of patches); choose --parallel.cp among {fits}, or another "
        "--model patch size or --image-size",
    )


def parallelism(cfg: TrainConfig, world: int | None = None) -> Parallelism:
    """The --parallel.* degrees, resolved for ``world`` ranks when given; ConfigError names the flags."""
    par = Parallelism(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, cfg.parallel.cp)
    try:
        if world is not None:
            par = par.resolve(world)
        arch = dit_arch(cfg.model)
        par.check_model(arch["hidden_size"], arch["num_heads"], int(arch["hidden_size"] * 4.0))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return par


def _validate_parallel(cfg: TrainConfig) -> None:
    """Degrees in range and a tensor-parallel degree the model can use; the world size is checked at start-up."""
    _check_positive_int("--parallel.dp-replicate", cfg.parallel.dp_replicate)
    _check_positive_int("--parallel.tp", cfg.parallel.tp)
    _check_positive_int("--parallel.cp", cfg.parallel.cp)
    _require(
        cfg.parallel.dp_shard == -1 or cfg.parallel.dp_shard >= 1,
        f"--parallel.dp-shard must be an integer >= 1, or -1 for the rest of the world, got {cfg.parallel.dp_shard}",
    )
    try:
        Parallelism(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp, cfg.parallel.cp).check_mesh()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for flag, degree in (("--parallel.tp", cfg.parallel.tp), ("--parallel.cp", cfg.parallel.cp)):
        _require(
            degree == 1 or cfg.optimizer not in ONE_PROCESS_ONLY,
            f"--optimizer {cfg.optimizer} runs in one process only; it cannot take {flag}",
        )
    _require(
        cfg.parallel.tp == 1 or cfg.optimizer != "adaptive_row_muon",
        "--optimizer adaptive_row_muon cannot take --parallel.tp: its staleness signal needs matrices sharded by "
        "rows, and the tensor-parallel plan splits attn.proj and mlp.fc2 by columns; use periodic_row_muon "
        "with --parallel.tp, or adaptive_row_muon with --parallel.dp-replicate / --parallel.dp-shard",
    )
    parallelism(cfg)


def _validate_eval(cfg: TrainConfig) -> None:
    """The --eval.* flags, checked only when evaluation is on (it may need packages or weight files)."""
    _check_positive_int("--eval.interval", cfg.eval.interval, 0)
    if cfg.eval.interval > 0:
        try:
            check_eval_settings(cfg.eval, prefix="--eval.")
        except ValueError as e:
            raise ConfigError(str(e)) from None


# --------------------------------------------------------------------------------------------------
# Resuming: which flags may change
# --------------------------------------------------------------------------------------------------

# Flags a resumed run cannot change, with the reason. Every other flag may change: the loop reads
# them afresh (lr, schedule, steps, intervals, evaluation, ...), and the optimizer's options and the
# EMA's decay are applied after the saved state is loaded (dimuon.train.checkpoint.load_training_state).
FROZEN_ON_RESUME: dict[str, str] = {
    "model": "the saved weights have its shapes",
    "dataset": "the model and the data order were made for it",
    "data_path": "the model and the data order were made for it",
    "image_size": "the model's input size is made for it",
    "channels": "the model's input channels are made for it",
    "num_classes": "the model's label table is made for it",
    "class_dropout": "it is part of the model's definition (its label table)",
    "optimizer": "the saved optimizer state belongs to that optimizer",
    "batch_size": "it decides which items every step reads (the data order)",
    "seed": "it fixes the data order and the training noise of every step",
}
# Optimizer options the saved state's layout depends on, per optimizer.
FROZEN_OPTIM_ON_RESUME: dict[str, dict[str, str]] = {
    "adamw": {
        "amsgrad": "AdamW keeps a max_exp_avg_sq buffer only with it",
        "fused": "where torch keeps AdamW's step counters depends on it",
        "capturable": "where torch keeps AdamW's step counters depends on it",
    },
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _same(name: str, a: Any, b: Any) -> bool:
    if name == "data_path" and a is not None and b is not None:  # a relative path (earlier runs), or a link
        pa, pb = Path(a).absolute(), Path(b).absolute()
        return pa == pb or (pa.exists() and pb.exists() and os.path.samefile(pa, pb))
    return a == b


def check_resume_flags(
    cfg: TrainConfig, saved: dict[str, Any], where: str, resolved: dict[str, Any] | None = None
) -> None:
    """Refuse a flag that a run resumed from ``saved`` (its config dict, in ``where``) cannot change. ``resolved``:
    what the data set made of flags the run left to it (e.g. ``image_size`` of a run without ``--image-size``),
    so that naming that value on resume is no change."""
    fresh = config_to_dict(cfg)
    saved_cfg = config_to_dict(config_from_dict(saved))  # defaults filled in, as it ran
    for name, value in (resolved or {}).items():
        if saved_cfg.get(name) is None and fresh.get(name) == value:
            fresh[name] = None  # the value the run had, named
    for name, reason in FROZEN_ON_RESUME.items():
        if not _same(name, fresh[name], saved_cfg[name]):
            was = saved_cfg[name]
            if was is None and name in (resolved or {}):
                was = f"{resolved[name]} (its data set's, the flag not given)"
            raise ConfigError(
                f"{_flag(name)} cannot change on resume ({reason}): {where} was trained with "
                f"{_flag(name)} {was}, this run asks for {fresh[name]}; resume without "
                f"{_flag(name)}, or start a new run (another --out, or --overwrite)"
            )
    defaults = {name: p.default for name, (p, _) in accepted_parameters(OPTIMIZERS[cfg.optimizer]).items()}
    for name, reason in FROZEN_OPTIM_ON_RESUME.get(cfg.optimizer, {}).items():
        keyword = OPTION_SPECS[name].keywords[cfg.optimizer]
        old, new = saved_cfg["optim"][name], fresh["optim"][name]
        old, new = (defaults[keyword] if v is None else v for v in (old, new))
        if old != new:
            raise ConfigError(
                f"--optim.{name.replace('_', '-')} cannot change on resume of --optimizer {cfg.optimizer} "
                f"({reason}): {where} was trained with {old}, this run asks for {new}"
            )


# How a run is continued, not what it runs: left out of what a resume changed.
HOW_CONTINUED = frozenset({"resume", "out", "overwrite"})


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def changed_on_resume(saved: dict[str, Any], record: dict[str, Any]) -> dict[str, list[Any]]:
    """The flags a resumed run runs with other values than the checkpoint's config ``saved`` (its defaults filled in,
    as it ran): ``{"--eval.interval": [500, 2000]}``, in config order; ``record`` is the new run's config dict."""
    was, now = (_flat(json.loads(to_json(r))) for r in (config_to_dict(config_from_dict(saved)), record))
    return {
        _flag(name): [was.get(name), value]
        for name, value in now.items()
        if name not in HOW_CONTINUED and not _same(name, was.get(name), value)
    }
