"""The one text of every optimizer option: the optimizers' docstrings and the command line's help are made from it.

Each table maps an option to its description (Google style: the first sentence is the flag's help). The Muon
family's shared options come from :data:`dimuon.optim.options.CORE_TABLE` (each text declared with its option's
default and check); a schedule's options carry their own text (``Option.doc``, in :mod:`dimuon.optim.schedules`);
torch's AdamW and the ``torch_muon`` baseline have theirs, for the flags."""

from __future__ import annotations

from collections.abc import Mapping

from dimuon.optim.options import CORE_TABLE

__all__ = ["ADAMW_OPTIONS", "CORE_OPTIONS", "TORCH_MUON_OPTIONS", "args_section"]

# The Muon family's shared options, their text declared with each option in one table.
CORE_OPTIONS: dict[str, str] = {option.name: option.doc for option in CORE_TABLE if option.doc}

# torch.optim.AdamW's options as dimuon.optim.build passes them (defaults: those of the Muon family's AdamW group).
ADAMW_OPTIONS: dict[str, str] = {
    "betas": "coefficients of the running averages of the gradient and its square.",
    "eps": "term added to the denominator for numerical stability.",
    "weight_decay": "decoupled weight decay coefficient.",
    "amsgrad": "use the AMSGrad variant (the maximum of the second moments so far).",
    "maximize": "maximize the objective instead of minimizing it.",
    "foreach": "torch's list (foreach) implementation.",
    "capturable": "safe to capture in a CUDA graph.",
    "differentiable": "let autograd run through the step.",
    "fused": "torch's fused implementation.",
    "decoupled_weight_decay": "decouple the weight decay from the gradient (AdamW's own form).",
}

TORCH_MUON_OPTIONS: dict[str, str] = {
    "weight_decay": "weight decay of both groups.",
    "momentum": "torch.optim.Muon's momentum.",
    "nesterov": "torch.optim.Muon's Nesterov momentum.",
    "ns_steps": "torch.optim.Muon's Newton-Schulz iterations.",
    "adjust_lr_fn": 'torch.optim.Muon\'s lr adjustment by shape: ``"match_rms_adamw"`` (one lr fits both groups) '
    'or ``"original"``.',
    "adamw_betas": 'AdamW\'s betas in the ``"adamw"`` groups.',
    "adamw_eps": 'AdamW\'s eps in the ``"adamw"`` groups.',
}


def args_section(title: str, docs: Mapping[str, str], width: int = 116) -> str:
    """A Google-style ``Args`` section of ``docs`` for a class docstring (indented by four)."""
    lines = [f"    {title}:"]
    for name, text in docs.items():
        line = f"        {name}:"
        for word in text.split():
            if len(line) + 1 + len(word) > width:
                lines.append(line)
                line = "           "
            line += " " + word
        lines.append(line)
    return "\n".join(lines) + "\n"
