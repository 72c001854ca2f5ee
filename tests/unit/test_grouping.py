"""Role-based grouping: DiT-style and diffusers-style names, user rules, fused splits."""

import pytest
import torch
from torch import nn

from dimuon.optim import DIT_FUSED_SPLITS, Muon, describe_groups, param_groups


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(d, 3 * d)
        self.attn.proj = nn.Linear(d, d)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, 4 * d)
        self.mlp.fc2 = nn.Linear(4 * d, d)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))


class TinyDiT(nn.Module):
    """Module names of a facebookresearch-style DiT."""

    def __init__(self, d=16):
        super().__init__()
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv2d(4, d, 2, 2)
        self.t_embedder = nn.Module()
        self.t_embedder.mlp = nn.Sequential(nn.Linear(32, d), nn.SiLU(), nn.Linear(d, d))
        self.y_embedder = nn.Module()
        self.y_embedder.embedding_table = nn.Embedding(11, d)
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, d), requires_grad=False)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.final_layer = nn.Module()
        self.final_layer.norm_final = nn.LayerNorm(d, elementwise_affine=False)
        self.final_layer.linear = nn.Linear(d, 16)
        self.final_layer.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))


def _by_algorithm(groups):
    out = {"muon": set(), "adamw": set()}
    for g in groups:
        out[g["algorithm"]].update(name for name, _ in g["params"])
    return out


def test_dit_roles():
    sets = _by_algorithm(param_groups(TinyDiT()))
    muon_expected = {
        f"blocks.{i}.{n}.weight"
        for i in range(2)
        for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1")
    } | {"t_embedder.mlp.2.weight", "final_layer.adaLN_modulation.1.weight"}
    assert sets["muon"] == muon_expected
    for name in (
        "x_embedder.proj.weight",
        "y_embedder.embedding_table.weight",
        "final_layer.linear.weight",
        "t_embedder.mlp.0.weight",
        "blocks.0.attn.qkv.bias",
        "x_embedder.proj.bias",
    ):
        assert name in sets["adamw"]
    assert "pos_embed" not in sets["muon"] | sets["adamw"]  # frozen parameters are left out


def test_diffusers_names():
    m = nn.Module()
    m.pos_embed = nn.Module()
    m.pos_embed.proj = nn.Conv2d(4, 8, 2, 2)
    blk = nn.Module()
    blk.norm1 = nn.Module()
    blk.norm1.emb = nn.Module()
    blk.norm1.emb.class_embedder = nn.Module()
    blk.norm1.emb.class_embedder.embedding_table = nn.Embedding(11, 8)
    blk.norm1.emb.timestep_embedder = nn.Module()
    blk.norm1.emb.timestep_embedder.linear_1 = nn.Linear(256, 8)
    blk.norm1.emb.timestep_embedder.linear_2 = nn.Linear(8, 8)
    blk.norm1.linear = nn.Linear(8, 48)
    blk.attn1 = nn.Module()
    blk.attn1.to_q = nn.Linear(8, 8)
    m.transformer_blocks = nn.ModuleList([blk])
    m.proj_out_1 = nn.Linear(8, 16)
    m.proj_out_2 = nn.Linear(8, 16)
    sets = _by_algorithm(param_groups(m))
    assert sets["muon"] == {
        "transformer_blocks.0.norm1.emb.timestep_embedder.linear_2.weight",
        "transformer_blocks.0.norm1.linear.weight",
        "transformer_blocks.0.attn1.to_q.weight",
        "proj_out_1.weight",  # the final layer's conditioning map, as DiT's final_layer.adaLN_modulation.1
    }
    assert {
        "pos_embed.proj.weight",
        "proj_out_2.weight",
        "transformer_blocks.0.norm1.emb.class_embedder.embedding_table.weight",
        "transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.weight",
    } <= sets["adamw"]


def test_user_rules_override_and_carry_options():
    groups = param_groups(
        TinyDiT(),
        rules=[
            ("*.adaLN_modulation.1.weight", {"algorithm": "adamw", "lr": 3e-4}),
            ("final_layer.linear.weight", "muon"),
        ],
    )
    sets = _by_algorithm(groups)
    assert "blocks.0.adaLN_modulation.1.weight" in sets["adamw"]
    assert "final_layer.linear.weight" in sets["muon"]
    lr_group = [g for g in groups if g.get("lr") == 3e-4]
    assert len(lr_group) == 1 and all("adaLN" in n for n, _ in lr_group[0]["params"])
    with pytest.raises(ValueError, match=r"rule 'x\*': algorithm must be one of \('muon', 'adamw'\)"):
        param_groups(TinyDiT(), rules={"x*": "sgd"})


def test_fused_splits_reach_the_optimizer():
    model = TinyDiT()
    groups = param_groups(model, split_sizes=DIT_FUSED_SPLITS)
    split = {n: g.get("split_sizes") for g in groups for n, _ in g["params"]}
    assert split["blocks.1.attn.qkv.weight"] == 3
    assert split["blocks.0.adaLN_modulation.1.weight"] == 6
    assert split["final_layer.adaLN_modulation.1.weight"] == 2
    assert split["blocks.0.mlp.fc1.weight"] is None
    opt = Muon(groups, lr=1e-3)
    x = torch.randn(2, 16)
    loss = sum(p.sum() for p in model.parameters() if p.requires_grad) * x.sum()
    loss.backward()
    opt.step()
    assert "blocks.0.attn.qkv.weight" in describe_groups(groups)


class ZooShapes(nn.Module):
    """What the DiT zoo registers beside linear maps: tables and tokens as bare parameters, Wan-style patch
    embedding, timestep and guidance MLPs, a torch MultiheadAttention."""

    def __init__(self, d=16):
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.randn(6, d))
        self.register_tokens = nn.Parameter(torch.randn(4, d))
        self.patch_embedding = nn.Conv3d(4, d, (1, 2, 2), (1, 2, 2))
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].scale_shift_table = nn.Parameter(torch.randn(1, 6, d))
        self.blocks[0].attn = nn.MultiheadAttention(d, 2)
        self.blocks[0].ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.condition_embedder = nn.Module()
        self.condition_embedder.time_embedder = nn.Module()
        self.condition_embedder.time_embedder.linear_1 = nn.Linear(256, d)
        self.condition_embedder.time_embedder.linear_2 = nn.Linear(d, d)
        self.guidance_embedder = nn.Module()
        self.guidance_embedder.linear_1 = nn.Linear(256, d)
        self.time_embedding = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.text_embedder = nn.Module()
        self.text_embedder.linear_1 = nn.Linear(32, d)  # reads text features, not sinusoids: a hidden map
        self.proj_out = nn.Linear(d, 16)


def test_bare_parameters_tables_patch_embeddings_and_sinusoidal_inputs_go_to_adamw():
    groups = param_groups(ZooShapes())
    muon = {n for g in groups if g["algorithm"] == "muon" for n, _ in g["params"]}
    assert muon == {
        "blocks.0.attn.in_proj_weight",
        "blocks.0.attn.out_proj.weight",
        "blocks.0.ffn.0.weight",
        "blocks.0.ffn.2.weight",
        "condition_embedder.time_embedder.linear_2.weight",
        "time_embedding.2.weight",
        "text_embedder.linear_1.weight",
    }
    rules = param_groups(ZooShapes(), rules={"scale_shift_table": "muon"})  # user rules still win
    assert "scale_shift_table" in {n for g in rules if g["algorithm"] == "muon" for n, _ in g["params"]}


def test_per_head_splits_qkv_rows_and_out_projection_columns_under_user_rules_too():
    model = TinyDiT(d=16)  # 2 blocks; its attention has no num_heads attribute: give it one, as DiT's has
    for block in model.blocks:
        block.attn.num_heads = 4
    groups = param_groups(
        model, rules={"blocks.1.attn.proj.weight": {"lr": 1e-3}}, split_sizes=DIT_FUSED_SPLITS, per_head=True
    )
    by_name = {n: g for g in groups for n, _ in g["params"]}
    assert by_name["blocks.0.attn.qkv.weight"]["split_sizes"] == 12  # 3 x 4 heads, refining the fused 3
    assert by_name["blocks.0.attn.proj.weight"]["col_split_sizes"] == 4
    assert (
        by_name["blocks.1.attn.proj.weight"]["col_split_sizes"] == 4
        and by_name["blocks.1.attn.proj.weight"]["lr"] == 1e-3
    )
    assert "col_split_sizes" not in by_name["blocks.0.mlp.fc1.weight"]
    assert "col_split_sizes" not in {k for g in param_groups(model) for k in g}  # off by default


class Wrapper(nn.Module):
    """A module holding the network (as an adapter, torch.compile or DDP does), with no parameters of its own."""

    def __init__(self, inner: nn.Module, name: str = "model") -> None:
        super().__init__()
        self.add_module(name, inner)
        self.act = nn.SiLU()  # a child without parameters does not stop the descent


def _roles_of(groups, prefix: str = "") -> dict:
    return {name[len(prefix) :]: (g["algorithm"], g.get("split_sizes")) for g in groups for name, _ in g["params"]}


@pytest.mark.parametrize("name", ["model", "_orig_mod", "module"])
def test_a_wrapped_model_is_grouped_as_the_bare_one(name):
    bare = _roles_of(param_groups(TinyDiT(), split_sizes=DIT_FUSED_SPLITS))
    wrapped = param_groups(Wrapper(TinyDiT(), name), split_sizes=DIT_FUSED_SPLITS)
    assert _roles_of(wrapped, f"{name}.") == bare
    assert bare["x_embedder.proj.weight"] == ("adamw", None) and bare["blocks.0.adaLN_modulation.1.weight"] == (
        "muon",
        6,
    )
    # Rules written for the bare model hold on the wrapped one too.
    rules = {"final_layer.linear.weight": "muon"}
    assert _roles_of(param_groups(Wrapper(TinyDiT(), name), rules=rules), f"{name}.")["final_layer.linear.weight"] == (
        "muon",
        None,
    )


def test_a_rule_s_own_split_wins_and_a_rule_matching_nothing_is_named():
    rules = {"blocks.*.adaLN_modulation.1.weight": {"algorithm": "muon", "split_sizes": 3}}
    got = _roles_of(param_groups(TinyDiT(), rules=rules, split_sizes=DIT_FUSED_SPLITS))
    assert got["blocks.1.adaLN_modulation.1.weight"] == ("muon", 3)
    with pytest.warns(UserWarning, match=r"rule\(s\) \['blocks\.\*\.atn\.qkv\.weight'\] matched no trainable"):
        param_groups(TinyDiT(), rules={"blocks.*.atn.qkv.weight": "adamw", "final_layer.linear.weight": "muon"})


def test_roles_set_the_algorithm_a_rule_with_options_only_keeps():
    roles = {"blocks.0.mlp.fc1.weight": "adamw"}
    got = param_groups(TinyDiT(), rules={"blocks.*.mlp.fc1.weight": {"lr": 1e-4}}, roles=roles)
    by_name = {name: g for g in got for name, _ in g["params"]}
    assert (
        by_name["blocks.0.mlp.fc1.weight"]["algorithm"] == "adamw" and by_name["blocks.0.mlp.fc1.weight"]["lr"] == 1e-4
    )
    assert by_name["blocks.1.mlp.fc1.weight"]["algorithm"] == "muon"  # no role there: the default's


class _Tied(nn.Module):
    """A token table tied to a hidden-named output linear, the two declared in the order given."""

    def __init__(self, head_first: bool):
        super().__init__()
        if head_first:
            self.out = nn.Linear(16, 32, bias=False)
        self.body = nn.Linear(16, 16)
        self.tok = nn.Embedding(32, 16)
        if not head_first:
            self.out = nn.Linear(16, 32, bias=False)
        self.out.weight = self.tok.weight  # tied


@pytest.mark.parametrize("head_first", [False, True])
def test_a_tied_weight_takes_its_role_whichever_module_was_registered_first(head_first):
    model = _Tied(head_first)
    reasons: dict[str, str] = {}
    groups = param_groups(model, reasons=reasons)
    where = {n: g["algorithm"] for g in groups for n, _ in g["params"]}
    listed = "out.weight" if head_first else "tok.weight"  # named as named_parameters() names it: its first name
    assert listed in where and ({"out.weight", "tok.weight"} - {listed}).isdisjoint(where)
    assert where[listed] == "adamw"  # an embedding table, also where the linear holding it came first
    assert "Embedding.weight" in reasons[listed]
    assert where["body.weight"] == "muon"
    # A rule names the parameter by any of its names.
    other = "tok.weight" if head_first else "out.weight"
    by_rule = {
        n: g for g in param_groups(model, rules={other: {"algorithm": "adamw", "lr": 1e-4}}) for n, _ in g["params"]
    }
    assert by_rule[listed]["lr"] == 1e-4
