"""EMA of weights: the update rule, state round trip, loading into a model, and FSDP2-sharded parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dimuon.dit.ema import EMA
from dimuon.dit.model import build_dit


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _shift(model: nn.Module, amount: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


def test_update_is_the_exponential_moving_average():
    model = _net()
    ema = EMA(model, decay=0.9)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _shift(model, 1.0)
    ema.update(model)
    for name, p in model.named_parameters():
        assert torch.allclose(ema.params[name], 0.9 * start[name] + 0.1 * p.detach(), atol=1e-6)
    _shift(model, 1.0)
    ema.update(model)
    # After two updates toward w+1 and w+2: w + 0.1*(0.9*1 + 2) = w + 0.29.
    for name in ema.params:
        assert torch.allclose(ema.params[name], start[name] + 0.29, atol=1e-6)
    assert ema.num_updates == 2


def test_buffers_are_copied_and_weights_load_into_a_model_strictly():
    model = _net()
    ema = EMA(model, decay=0.5)
    model.train()
    model(torch.randn(16, 4))  # moves the BatchNorm running statistics
    ema.update(model)
    assert torch.equal(ema.buffers["1.running_mean"], model[1].running_mean)
    assert ema.buffers["1.num_batches_tracked"].item() == 1
    assert set(ema.weights()) == set(model.state_dict())
    fresh = _net()
    fresh.load_state_dict(ema.weights())  # strict: same keys and shapes as the model
    assert torch.equal(fresh[0].weight, ema.params["0.weight"])


def test_decay_limits_and_warmup():
    model = _net()
    frozen, copying = EMA(model, decay=1.0), EMA(model, decay=0.0)
    before = {k: v.clone() for k, v in frozen.params.items()}
    _shift(model, 3.0)
    frozen.update(model)
    copying.update(model)
    for name, p in model.named_parameters():
        assert torch.equal(frozen.params[name], before[name])
        assert torch.equal(copying.params[name], p.detach())
    warm = EMA(model, decay=0.999, warmup=True)
    seen = []
    for _ in range(3):
        seen.append(warm.current_decay())
        warm.update(model)
    assert seen == pytest.approx([1 / 10, 2 / 11, 3 / 12])
    with pytest.raises(ValueError, match=r"EMA decay must be in \[0, 1\]"):
        EMA(model, decay=1.5)


def test_state_dict_round_trip():
    model = _net()
    ema = EMA(model, decay=0.8, warmup=True)
    _shift(model, 0.5)
    ema.update(model)
    other = EMA(_net(), decay=0.1)
    other.load_state_dict(ema.state_dict())
    assert (other.decay, other.warmup, other.num_updates) == (0.8, True, 1)
    for name, value in ema.weights().items():
        assert torch.equal(other.weights()[name], value)
    broken = ema.state_dict()
    broken["weights"] = {k: v for k, v in broken["weights"].items() if k != "0.bias"}
    with pytest.raises(KeyError, match=r"missing \['0.bias'\]"):
        other.load_state_dict(broken)


def test_copy_to_and_swapped_into_for_sampling():
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    ema = EMA(model, decay=0.5)
    _shift(model, 0.01)
    ema.update(model)  # EMA = init + 0.005
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped_into(model) as m:
        for name, p in m.named_parameters():
            assert torch.allclose(p, trained[name] - 0.005, atol=1e-6)
    for name, p in model.state_dict().items():
        assert torch.equal(p, trained[name])  # training weights are back
    target = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    ema.copy_to(target)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in ema.weights().items())


def test_fp32_ema_of_a_bf16_model():
    model = _net().to(torch.bfloat16)
    ema = EMA(model, decay=0.75, dtype=torch.float32)
    assert all(v.dtype == torch.float32 for v in ema.params.values())
    start = {k: v.clone() for k, v in ema.params.items()}
    _shift(model, 1.0)
    ema.update(model)
    for name, p in model.named_parameters():
        assert torch.allclose(ema.params[name], 0.75 * start[name] + 0.25 * p.detach().float(), atol=1e-6)


def test_ema_on_fsdp2_sharded_parameters(tmp_path):
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already in this process")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        plain = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
        sharded = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
        sharded.load_state_dict(plain.state_dict())
        fully_shard(sharded)
        assert all(isinstance(p, DTensor) for p in sharded.parameters())
        ema_plain, ema_sharded = EMA(plain, decay=0.9), EMA(sharded, decay=0.9)
        assert all(isinstance(v, DTensor) for v in ema_sharded.params.values())
        opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
        opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
        x = torch.randn(5, 4)
        for model, opt, ema in ((plain, opt_p, ema_plain), (sharded, opt_s, ema_sharded)):
            for _ in range(3):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                ema.update(model)
        for name, value in ema_plain.params.items():
            assert torch.allclose(ema_sharded.params[name].full_tensor(), value, atol=1e-6)
        state = ema_sharded.state_dict()
        assert isinstance(state["weights"]["0.weight"], DTensor)  # checkpointable as shards
        ema_sharded.copy_to(sharded)
        for name, p in sharded.named_parameters():
            assert torch.allclose(p.full_tensor(), ema_plain.params[name], atol=1e-6)
    finally:
        dist.destroy_process_group()
