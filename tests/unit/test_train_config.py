"""``dimuon train`` configuration: flags, defaults, round trips and start-up errors for bad values."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dimuon.train.config import (
    ConfigError,
    OptimOptions,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    validate,
)
from dimuon.train.distributed import DataParallel, DistEnv
from dimuon.train.loop import open_data
from dimuon.train.lr_schedule import lr_factor
from dimuon.train.plan import data_spec, resolve
from dimuon.train.run import main, parse_config


def test_help_lists_every_required_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # undo the help's line wrapping
    for flag in (
        "--model",
        "--optimizer",
        "--lr",
        "--steps",
        "--batch-size",
        "--seed",
        "--out",
        "--resume",
        "--optim.k",
        "--optim.gamma",
        "--ema-decay",
        "--grad-clip",
        "--ckpt-interval",
        "--schedule",
    ):
        assert flag in text, flag
    assert "(default: DiT-XS/4)" in text and "(default: periodic_row_muon)" in text


def test_unknown_flag_is_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--learning-rate", "0.1"])
    assert exit_info.value.code != 0


def test_flags_reach_the_config_including_nested_optimizer_options() -> None:
    cfg = parse_config(
        [
            "--model",
            "DiT-T/4",
            "--lr",
            "0.02",
            "--batch-size",
            "32",
            "--steps",
            "7",
            "--seed",
            "3",
            "--out",
            "x",
            "--optim.k",
            "5",
            "--optim.betas",
            "0.8",
            "0.9",
        ]
    )
    assert (cfg.model, cfg.lr, cfg.batch_size, cfg.steps, cfg.seed, cfg.out) == ("DiT-T/4", 0.02, 32, 7, 3, "x")
    assert cfg.optim.k == 5 and cfg.optim.betas == (0.8, 0.9)


def test_config_round_trips_through_its_dict() -> None:
    cfg = TrainConfig(model="DiT-T/2", lr=0.1, optim=OptimOptions(k=4, betas=(0.5, 0.6), ns_dtype="bfloat16"))
    assert config_from_dict(config_to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="unknown keys"):
        config_from_dict({**config_to_dict(cfg), "learning_rate": 1})


def test_optimizer_kwargs_use_each_optimizer_s_own_names() -> None:
    muon = TrainConfig(optimizer="muon", optim=OptimOptions(betas=(0.9, 0.99), eps=1e-6, ns_dtype="float32"))
    assert resolve(muon).optimizer.kwargs == {
        "lr": muon.lr,
        "adamw_betas": (0.9, 0.99),
        "adamw_eps": 1e-6,
        "ns_dtype": torch.float32,
    }
    adamw = TrainConfig(optimizer="adamw", optim=OptimOptions(betas=(0.9, 0.99), weight_decay=0.1))
    assert resolve(adamw).optimizer.kwargs == {"lr": adamw.lr, "betas": (0.9, 0.99), "weight_decay": 0.1}


def test_dataset_kwargs_rebuild_the_data_set() -> None:
    assert data_spec(TrainConfig()).kwargs == {}
    folder = TrainConfig(dataset="folder", data_path="/d", image_size=32, channels=1)
    assert data_spec(folder).as_record() == {
        "name": "folder",
        "kwargs": {"root": "/d", "image_size": 32, "channels": 1},
    }


def test_defaults_are_valid() -> None:
    validate(TrainConfig())
    plan = resolve(TrainConfig())
    assert plan.optimizer.name == "periodic_row_muon" and plan.evaluation is None
    assert plan.layout.root.as_posix() == "runs/mnist-demo" and plan.record == config_to_dict(TrainConfig())


def test_configs_saved_before_parallel_degrees_load_as_fsdp_over_all_ranks() -> None:
    saved = config_to_dict(TrainConfig())
    del saved["parallel"]
    cfg = config_from_dict(saved)
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp) == (1, -1, 1)
    assert parse_config(["--parallel.tp", "2", "--parallel.dp-shard", "2"]).parallel.tp == 2
    three = parse_config(["--parallel.dp-replicate", "2", "--parallel.dp-shard", "2", "--parallel.tp", "2"]).parallel
    assert (three.dp_replicate, three.dp_shard, three.tp) == (2, 2, 2)  # HSDP over tensor parallelism: a 3-D mesh


def test_configs_saved_before_the_validation_subset_choice_load_as_the_first_items() -> None:
    saved = config_to_dict(TrainConfig())
    assert saved["val_subset"] == "balanced"
    del saved["val_subset"]  # such runs scored the split's first --val-samples images
    assert config_from_dict(saved).val_subset == "first"
    assert parse_config(["--val-subset", "first"]).val_subset == "first"
    with pytest.raises(ConfigError, match=r"^--val-subset must be balanced or first, got 'random'$"):
        validate(TrainConfig(val_subset="random"))  # type: ignore[arg-type]


def test_the_validation_images_take_the_classes_in_turn(tmp_path) -> None:
    # MNIST's val split is in class order: its first 256 images are digits 0-4 only.
    data = open_data(
        resolve(TrainConfig(out=str(tmp_path / "run"))), DistEnv(0, 1, torch.device("cpu")), DataParallel(0, 1)
    )
    assert len(data.val_y) == 256 and torch.bincount(data.val_y, minlength=10).min() >= 25
    first = open_data(
        resolve(TrainConfig(out=str(tmp_path / "run"), val_subset="first")),
        DistEnv(0, 1, torch.device("cpu")),
        DataParallel(0, 1),
    )
    assert (torch.bincount(first.val_y, minlength=10) == 0).sum() >= 4


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--optimizer", "sgd"], "--optimizer must be one of: adamw, muon, periodic_row_muon, muon_bp"),
        (["--lr", "-0.001"], "--lr must be a positive number"),
        (["--lr", "0"], "--lr must be a positive number"),
        (["--model", "DiT-Q/4"], "--model must be one of"),
        (["--steps", "0"], "--steps must be an integer >= 1"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
        (["--image-size", "30"], "patch size 4, which does not divide the image size 30"),
        (["--dataset", "folder", "--image-size", "28"], "--dataset folder needs --data-path"),
        (["--dataset", "arrays", "--data-path", "/no/such/place"], "--data-path /no/such/place does not exist"),
        (["--dataset", "imagenet"], "--dataset must be one of"),
        (["--data-path", "/tmp"], "--data-path is not used by --dataset mnist"),
        (["--ema-decay", "1.5"], "--ema-decay must be in [0, 1]"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**31), got -1"),
        (["--val-seed", "20000000000000"], "--val-seed must be an integer in [0, 2**31)"),
        (["--optimizer", "muon", "--optim.k", "3"], "--optimizer muon rejects its options"),
        (["--optim.momentum", "1.5"], "momentum"),
        (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
        (["--schedule", "constant", "--min-lr-ratio", "0.5"], "--min-lr-ratio 0.5 has no effect here (--schedule con"),
        (["--skip-limit", "3"], "--skip-limit 3 has no effect here (it counts skipped steps: --nonfinite skip)"),
        (["--parallel.tp", "3"], "--parallel.tp (3) must divide the model's 4 attention heads"),
        (["--parallel.tp", "0"], "--parallel.tp must be an integer >= 1"),
        (["--parallel.dp-shard", "0"], "--parallel.dp-shard must be an integer >= 1, or -1"),
        (["--parallel.cp", "0"], "--parallel.cp must be an integer >= 1, got 0"),
        (
            ["--parallel.cp", "2", "--image-size", "28"],
            "--parallel.cp 2 must divide the 49 tokens per image of --model DiT-XS/4 on 28x28 images (a 7 x 7 grid of "
            "patches); choose --parallel.cp among 1, 7, 49",
        ),
        (["--optimizer", "torch_muon", "--parallel.cp", "2"], "--optimizer torch_muon runs in one process only"),
        (
            ["--parallel.cp", "2"],
            "--parallel.dp-replicate (1) x --parallel.tp (1) x --parallel.cp (2) must divide the world size 1",
        ),
        (
            ["--parallel.cp", "2", "--parallel.dp-shard", "2"],
            "--parallel.dp-replicate x --parallel.dp-shard x --parallel.tp x --parallel.cp = 1 x 2 x 1 x 2 = 4 must "
            "equal the world size 1",
        ),
        (["--optimizer", "torch_muon", "--parallel.tp", "2"], "--optimizer torch_muon runs in one process only"),
        (
            ["--optimizer", "adaptive_row_muon", "--parallel.tp", "2"],
            "--optimizer adaptive_row_muon cannot take --parallel.tp: its staleness signal needs matrices sharded "
            "by rows",
        ),
        (
            ["--parallel.dp-shard", "2"],
            "--parallel.dp-replicate x --parallel.dp-shard x --parallel.tp = 1 x 2 x 1 = 2 must equal the world size 1",
        ),
        *(
            [(["--device", "cuda"], "--device cuda: CUDA is not available here (auto or cpu run on the CPU)")]
            if not torch.cuda.is_available()
            else []
        ),
    ],
)
def test_bad_values_fail_at_start_up_with_a_message_naming_the_flag(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    code = main([*flags, "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp_path / "run").exists()  # nothing was written


def test_a_device_training_cannot_use_is_refused_naming_the_flag_and_the_allowed_values() -> None:
    # The parser takes auto, cpu and cuda only; a config built in Python is checked as strictly: each rank picks
    # its own GPU, so a device index would be ignored.
    with pytest.raises(ConfigError, match=r"^--device must be one of: auto, cpu, cuda; got 'cuda:1'$"):
        validate(TrainConfig(device="cuda:1"))  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^--device cuda: CUDA is not available here"):
            validate(TrainConfig(device="cuda"))
    validate(TrainConfig(device="cpu"))


def test_patch_size_that_does_not_divide_the_data_set_s_images_fails_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    # DiT-S/8 on 28x28 MNIST: only known once the data set is opened, still before any model is built.
    code = main(["--model", "DiT-S/8", "--out", str(tmp_path / "run")])
    assert code == 2
    assert "patch size 8, which does not divide the image size 28" in capsys.readouterr().err


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    f = [lr_factor(s, 100, 10, "cosine", 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(f[9:]))
    assert f[-1] == pytest.approx(0.1)
    assert lr_factor(55, 100, 10, "constant", 0.1) == 1.0
    lin = [lr_factor(s, 21, 0, "linear", 0.0) for s in range(21)]
    assert lin[0] == 1.0 and lin[10] == pytest.approx(0.5) and lin[20] == pytest.approx(0.0)
    assert math.isclose(lr_factor(0, 1, 0, "cosine", 0.2), 1.0)
