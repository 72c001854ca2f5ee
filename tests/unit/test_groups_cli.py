"""``dimuon groups``: a model's parameters by algorithm, with shapes, splits and reasons, before training it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dimuon.cli import main


def test_registry_model_with_the_dit_splits(capsys, tmp_path):
    out = tmp_path / "groups.json"
    assert main(["groups", "--model", "DiT-S/2", "--split", "dit", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dimuon DiT-S/2: 131 trainable tensors" in text
    assert "muon   blocks.0.attn.qkv.weight" in text and "as 3 x (384x384, 384x384, 384x384)" in text
    assert "adamw  y_embedder.embedding_table.weight" in text and "(Embedding.weight)" in text
    rows = {r["name"]: r for r in json.loads(out.read_text())["parameters"]}
    assert rows["final_layer.linear.weight"]["algorithm"] == "adamw"
    assert rows["blocks.0.adaLN_modulation.1.weight"]["matrices"] == [[384, 384]] * 6
    assert rows["blocks.0.mlp.fc1.weight"]["reason"] == "a hidden linear map"


def test_a_diffusers_class_full_size_on_the_meta_device_and_tiny(capsys, tmp_path):
    pytest.importorskip("diffusers")
    assert main(["groups", "--diffusers", "PixArtTransformer2DModel"]) == 0  # 600M parameters, no memory
    text = capsys.readouterr().out
    assert "adamw  scale_shift_table" in text and "not the weight of a linear map" in text
    config = tmp_path / "config.json"  # a diffusers config.json as it is on disk
    config.write_text(
        json.dumps({"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.30", "num_layers": 2})
    )
    assert (
        main(
            [
                "groups",
                "--diffusers",
                "WanTransformer3DModel",
                "--tiny",
                "--config-file",
                str(config),
                "--rule",
                "blocks.1.*=adamw",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "adamw  patch_embedding.weight" in text and "muon   blocks.0.ffn.net.2.weight" in text
    assert "adamw  blocks.1.ffn.net.2.weight" in text and "user rule 'blocks.1.*'" in text


def test_a_builder_callable_with_arguments(capsys):
    assert main(["groups", "--builder", "torch.nn:Linear", "--config", "in_features=3", "out_features=4", "--all"]) == 0
    text = capsys.readouterr().out
    assert "muon   weight" in text and "adamw  bias" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "DiT-S/2", "--builder", "torch.nn:Linear"], "exactly one of --model, --diffusers, --builder"),
        (["--model", "DiT-S/2", "--tiny"], "--tiny shrinks a diffusers class"),
        (["--model", "DiT-S/2", "--rule", "x=sgd"], "the algorithm must be 'adamw' or 'muon'"),
        (["--model", "DiT-S/2", "--split", "*qkv*=a"], "sizes must be integers"),
        (["--model", "DiT-S/2", "--config", "depth"], "--config expects key=value"),
        (["--model", "DiT-S/2", "--config", "nope=1"], "does not build with these arguments"),
        (["--builder", "torch.nn"], "--builder expects module:callable"),
        (["--builder", "torch.nn:NoSuchThing"], "has no attribute 'NoSuchThing'"),
        (["--model", "DiT-S/2", "--split", "*attn.qkv.weight=5"], "must divide its 1152 rows evenly"),
    ],
)
def test_bad_flags_say_which_and_exit_2(capsys, argv, message):
    assert main(["groups", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_config_file_that_is_not_a_json_object_is_named(tmp_path, capsys):
    not_an_object = "must hold a JSON object of constructor arguments, not a JSON list"
    for text, words in (("[1]", not_an_object), ("{", "not JSON")):
        path = tmp_path / "config.json"
        path.write_text(text)
        assert main(["groups", "--builder", "torch.nn:Linear", "--config-file", str(path)]) == 2
        assert f"--config-file {path}" in (err := capsys.readouterr().err) and words in err


def test_per_head_shows_each_heads_matrices(capsys):
    assert main(["groups", "--model", "DiT-S/2", "--split", "dit", "--per-head"]) == 0  # 6 heads of 64
    text = capsys.readouterr().out
    assert "blocks.0.attn.qkv.weight" in text and "as 18 matrices of 64x384" in text
    assert "as 6 x (384x64, 384x64, 384x64, 384x64, 384x64, 384x64)" in text  # the out-projection's columns


def test_a_json_write_that_fails_part_way_keeps_the_previous_table(tmp_path):
    """--json goes through the atomic writer: a write cut short (a file-size limit here, as a full disk would)
    fails, and the previous table is still whole."""
    out = tmp_path / "groups.json"
    assert main(["groups", "--model", "DiT-T/2", "--json", str(out)]) == 0
    before = out.read_text()
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "from dimuon.cli import main\n"
        f"sys.exit(main(['groups', '--model', 'DiT-XS/2', '--json', {str(out)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "File too large" in done.stderr + done.stdout
    assert out.read_text() == before
    assert len(json.loads(before)["parameters"]) > 0


def test_the_final_conditioning_map_goes_to_muon_in_dit_and_diffusers_alike_with_its_reason(tmp_path):
    # One role, one rule: DiT's final_layer.adaLN_modulation.1 and diffusers' proj_out_1 map the conditioning
    # vector to the final shift and scale, as every block's adaLN modulation does.
    pytest.importorskip("diffusers")
    rows = {}
    for source, name in (
        (["--model", "DiT-S/2"], "final_layer.adaLN_modulation.1.weight"),
        (["--diffusers", "DiTTransformer2DModel"], "proj_out_1.weight"),
    ):
        out = tmp_path / "groups.json"
        assert main(["groups", *source, "--json", str(out)]) == 0
        rows[name] = {r["name"]: r for r in json.loads(out.read_text())["parameters"]}[name]
    for name, row in rows.items():
        assert row["algorithm"] == "muon", name
        assert row["reason"].startswith("the final layer's conditioning map"), row["reason"]
