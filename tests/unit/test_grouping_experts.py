"""The mixture-of-experts rule of ``param_groups``: a bare 3-D parameter under a name holding ``experts`` goes to a
stacked Muon group (one matrix per expert), as torchtitan's and transformers' MoE layers name them; nothing else
does."""

import torch
from torch import nn

from dimuon.groups import group_table
from dimuon.optim import param_groups


class GroupedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.randn(4, 8, 6))
        self.w2_EDF = nn.Parameter(torch.randn(4, 6, 8))


class MoEBlock(nn.Module):
    """torchtitan 0.3.0's names (``moe.routed_experts.inner_experts.w1_EFD``, ``moe.router.gate``), transformers'
    (``mlp.experts.gate_up_proj``), and what must stay as it was: a conv under ``experts``, a 3-D table."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = nn.Module()
        self.moe.router = nn.Module()
        self.moe.router.gate = nn.Linear(6, 4, bias=False)
        self.moe.routed_experts = nn.Module()
        self.moe.routed_experts.inner_experts = GroupedExperts()
        self.mlp = nn.Module()
        self.mlp.experts = nn.Module()
        self.mlp.experts.gate_up_proj = nn.Parameter(torch.randn(4, 16, 6))
        self.convs = nn.Module()
        self.convs.experts = nn.ModuleList([nn.Conv1d(4, 4, 3)])
        self.table = nn.Parameter(torch.randn(4, 8, 6))


def _where(model: nn.Module, **kwargs) -> dict[str, dict]:
    return {
        name: {k: v for k, v in g.items() if k != "params"}
        for g in param_groups(model, **kwargs)
        for name, _ in g["params"]
    }


def test_stacked_experts_go_to_a_stacked_muon_group():
    reasons: dict[str, str] = {}
    where = _where(MoEBlock(), reasons=reasons)
    for name in (
        "moe.routed_experts.inner_experts.w1_EFD",
        "moe.routed_experts.inner_experts.w2_EDF",
        "mlp.experts.gate_up_proj",
    ):
        assert where[name] == {"algorithm": "muon", "stacked": True}, name
        assert reasons[name].startswith("stacked experts (E, m, n)"), reasons[name]
    assert where["convs.experts.0.weight"] == {"algorithm": "muon"}  # a conv weight: its (out, in*k) flattening
    assert where["table"] == {"algorithm": "adamw"}  # 3-D but no expert in its name
    assert where["moe.router.gate.weight"] == {"algorithm": "muon"}  # 2-D: a plain hidden linear map


def test_a_rule_wins_over_the_experts_rule():
    where = _where(MoEBlock(), rules={"*inner_experts.w2_EDF": "adamw", "mlp.experts.*": {"stacked": False}})
    assert where["moe.routed_experts.inner_experts.w2_EDF"] == {"algorithm": "adamw"}
    assert where["mlp.experts.gate_up_proj"] == {"stacked": False, "algorithm": "muon"}
    assert where["moe.routed_experts.inner_experts.w1_EFD"] == {"algorithm": "muon", "stacked": True}


def test_dimuon_groups_counts_every_expert_as_a_matrix():
    rows = {r["name"]: r for r in group_table(MoEBlock())}
    assert rows["mlp.experts.gate_up_proj"]["matrices"] == [[16, 6]] * 4
    assert "stacked experts" in rows["mlp.experts.gate_up_proj"]["reason"]


def test_experts_held_alone_keep_their_rule():
    """A model whose one child is the experts module: the wrapper prefix it strips is the name that marks them."""
    model = nn.Module()
    model.experts = nn.Module()
    model.experts.w1 = nn.Parameter(torch.randn(4, 16, 8))
    assert _where(model) == {"experts.w1": {"algorithm": "muon", "stacked": True}}
