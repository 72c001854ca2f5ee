"""``dimuon groups``: which parameter of a model goes to Muon and which to AdamW, and why, before training it.

The model is built on the meta device (shapes only, no memory), so a full-size configuration of a 12B
transformer prints in seconds. Three kinds of model:

    dimuon groups --model DiT-XL/2                                  # dimuon's registry
    dimuon groups --diffusers FluxTransformer2DModel --tiny         # a diffusers class (--config-file, --config)
    dimuon groups --builder mypkg.models:make_dit --config depth=4  # any callable returning an nn.Module

``--rule PATTERN=adamw`` and ``--split PATTERN=N`` are ``param_groups``' ``rules`` and ``split_sizes``
(``--split dit`` takes dimuon's DiT fused splits); ``--json FILE`` writes the table as JSON.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import tyro
from torch import nn

from dimuon.io import read_json_object, write_text_atomic
from dimuon.log import run_command
from dimuon.optim import DIT_FUSED_SPLITS, param_groups
from dimuon.optim.distributed.engine import split_sizes_to_ranges

__all__ = ["GroupsConfig", "group_table", "main", "parse"]


@dataclass
class GroupsConfig:
    """Print which parameters of a model each algorithm updates, with shapes, split sizes and the reason."""

    model: str | None = None
    """A dimuon registry model, e.g. DiT-S/2 (built for 32x32x4 latents and 1000 classes unless --config says)."""
    diffusers: str | None = None
    """A diffusers model class, e.g. FluxTransformer2DModel (its default config unless --tiny or --config-file)."""
    builder: str | None = None
    """module:callable that returns an nn.Module; --config entries are its keyword arguments."""
    config_file: Path | None = None
    """A JSON file of constructor arguments (a diffusers config.json works as it is)."""
    config: tuple[str, ...] = ()
    """Constructor arguments as key=value [key=value ...] (values read as JSON where they parse, else as strings)."""
    tiny: bool = False
    """With --diffusers: every size of the class's defaults shrunk (one layer, two heads), as dimuon's tests use."""
    rule: tuple[str, ...] = ()
    """param_groups rules as PATTERN=adamw or PATTERN=muon [...] (globs on parameter names; the first match wins)."""
    split: tuple[str, ...] = ()
    """Fused-matrix row splits as PATTERN=N or PATTERN=R1,R2,...; 'dit' alone: dimuon's DiT splits."""
    per_head: bool = False
    """Attention projections orthogonalized per head (param_groups(per_head=True))."""
    all: bool = False
    """List every parameter; by default biases and norm gains (1-D) are counted, not listed."""
    json: Path | None = None
    """Also write the table as JSON here."""


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pairs(flag: str, items: Sequence[str], form: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects {form}, got {item!r}")
        out[key] = value
    return out


def constructor_args(cfg: GroupsConfig) -> dict[str, Any]:
    """--config-file updated with --config."""
    args: dict[str, Any] = {}
    if cfg.config_file is not None:
        args = read_json_object(cfg.config_file, "--config-file", "a JSON object of constructor arguments")
        args = {k: v for k, v in args.items() if not k.startswith("_")}  # diffusers' _class_name, _diffusers_version
    args.update({k: _value(v) for k, v in _pairs("--config", cfg.config, "key=value").items()})
    return args


def build_model(cfg: GroupsConfig) -> tuple[nn.Module, str]:
    """The model the flags name, on the meta device, and a line saying what it is."""
    chosen = [flag for flag in ("model", "diffusers", "builder") if getattr(cfg, flag)]
    if len(chosen) != 1:
        raise ValueError(f"give exactly one of --model, --diffusers, --builder (got {len(chosen)})")
    if cfg.tiny and not cfg.diffusers:
        raise ValueError("--tiny shrinks a diffusers class's defaults: use it with --diffusers")
    args = constructor_args(cfg)
    try:
        return _build(cfg, args)
    except TypeError as exc:  # a constructor argument the model does not take
        raise ValueError(f"the model does not build with these arguments: {exc}") from None


def _build(cfg: GroupsConfig, args: dict[str, Any]) -> tuple[nn.Module, str]:
    with torch.device("meta"):
        if cfg.model:
            from dimuon.dit import build_dit

            model = build_dit(cfg.model, **{"input_size": 32, "in_channels": 4, "num_classes": 1000, **args})
            what = f"dimuon {cfg.model}"
        elif cfg.diffusers:
            from dimuon.dit.diffusers_zoo import build_tiny, transformer_class

            cls = transformer_class(cfg.diffusers)
            model = build_tiny(cls, **args) if cfg.tiny else cls(**args)
            what = f"diffusers {cfg.diffusers}" + (" (tiny)" if cfg.tiny else "")
        else:
            module_name, sep, attr = cfg.builder.partition(":")
            if not sep:
                raise ValueError(f"--builder expects module:callable, got {cfg.builder!r}")
            try:
                make = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"--builder {cfg.builder}: {exc}") from None
            model = make(**args)
            if not isinstance(model, nn.Module):
                raise ValueError(f"--builder {cfg.builder} returned a {type(model).__name__}, not an nn.Module")
            what = cfg.builder
    return model, what


def grouping_options(cfg: GroupsConfig) -> tuple[dict[str, str], dict[str, Any]]:
    """``rules`` and ``split_sizes`` for param_groups from --rule and --split."""
    rules = _pairs("--rule", cfg.rule, "PATTERN=adamw|muon")
    for pattern, algorithm in rules.items():
        if algorithm not in ("adamw", "muon"):
            raise ValueError(f"--rule {pattern}={algorithm}: the algorithm must be 'adamw' or 'muon'")
    splits: dict[str, Any] = {}
    for item in cfg.split:
        if item == "dit":
            splits.update(DIT_FUSED_SPLITS)
            continue
        for pattern, value in _pairs("--split", [item], "PATTERN=N, PATTERN=R1,R2,... or dit").items():
            try:
                sizes = [int(v) for v in value.split(",")]
            except ValueError:
                raise ValueError(f"--split {item}: sizes must be integers") from None
            splits[pattern] = sizes[0] if len(sizes) == 1 else tuple(sizes)
    return rules, splits


def group_table(
    model: nn.Module,
    rules: dict[str, str] | None = None,
    split_sizes: dict[str, Any] | None = None,
    per_head: bool = False,
) -> list[dict[str, Any]]:
    """One row per parameter: name, shape, algorithm, the matrices Muon updates (rows x cols of every row chunk x
    column chunk, per expert when stacked), why."""
    reasons: dict[str, str] = {}
    rows = []
    for group in param_groups(model, rules=rules, split_sizes=split_sizes, reasons=reasons, per_head=per_head):
        for name, p in group["params"]:
            row: dict[str, Any] = {
                "name": name,
                "shape": list(p.shape),
                "numel": p.numel(),
                "algorithm": group["algorithm"],
                "reason": reasons[name],
            }
            if group["algorithm"] == "muon":
                shape = p.shape[1:] if group.get("stacked") else p.shape
                rows_, cols = shape[0], math.prod(shape[1:])  # no split: one range over the whole side
                row_ranges = split_sizes_to_ranges(rows_, group.get("split_sizes"), name) or ((0, rows_),)
                col_ranges = split_sizes_to_ranges(
                    cols, group.get("col_split_sizes"), name, "col_split_sizes", "columns"
                ) or ((0, cols),)
                chunks = [[r1 - r0, c1 - c0] for r0, r1 in row_ranges for c0, c1 in col_ranges]
                row["matrices"] = chunks * (p.shape[0] if group.get("stacked") else 1)
            rows.append(row)
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return sorted(rows, key=lambda r: order[r["name"]])


def render(rows: list[dict[str, Any]], what: str, everything: bool) -> str:
    """The table, then per algorithm the number of tensors and parameters."""
    lines = [f"{what}: {len(rows)} trainable tensors, {sum(r['numel'] for r in rows):,} parameters", ""]
    width = max((len(r["name"]) for r in rows), default=10)
    shown = [r for r in rows if everything or len(r["shape"]) >= 2]
    for r in shown:
        shape = "x".join(map(str, r["shape"])) or "scalar"
        matrices = r.get("matrices")
        distinct = sorted({(m, n) for m, n in matrices or []}, reverse=True)
        as_matrix = (
            ""
            if not matrices
            else " as "
            + (
                f"{matrices[0][0]}x{matrices[0][1]}"
                if len(matrices) == 1
                else f"{len(matrices)} x ({', '.join(f'{m}x{n}' for m, n in matrices)})"
                if len(matrices) <= 6
                else f"{len(matrices)} matrices of {', '.join(f'{m}x{n}' for m, n in distinct)}"
            )
        )
        lines.append(f"{r['algorithm']:6s} {r['name']:{width}s} {shape:>16s}{as_matrix}  - {r['reason']}")
    hidden = len(rows) - len(shown)
    if hidden:
        lines.append(
            f"(and {hidden} tensors of fewer than 2 dimensions, all adamw unless a rule says otherwise: "
            "--all lists them)"
        )
    lines.append("")
    for algorithm in ("muon", "adamw"):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        lines.append(f"{algorithm}: {len(mine)} tensors, {sum(r['numel'] for r in mine):,} parameters")
    return "\n".join(lines)


def run(cfg: GroupsConfig) -> list[dict[str, Any]]:
    rules, splits = grouping_options(cfg)
    model, what = build_model(cfg)
    rows = group_table(model, rules, splits, cfg.per_head)
    print(render(rows, what, cfg.all))
    if cfg.json is not None:
        write_text_atomic(cfg.json, json.dumps({"model": what, "parameters": rows}, indent=2) + "\n")
        print(f"wrote {cfg.json}")
    return rows


def parse(argv: Sequence[str]) -> GroupsConfig:
    """``dimuon groups``'s flags, nothing built: SystemExit(2) for a flag the parser refuses, ValueError for a
    --rule or --split that :func:`grouping_options` refuses (the model's own checks are left to the run)."""
    cfg = tyro.cli(GroupsConfig, args=list(argv), prog="dimuon groups")
    grouping_options(cfg)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dimuon groups``: 0 printed, 2 bad flags or a model that does not build."""
    args = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        run(parse(args))
        return 0

    return run_command("dimuon groups", body, usage=(ValueError,), interrupted="nothing was written")


if __name__ == "__main__":
    sys.exit(main())
