"""The one text of every optimizer option: the optimizers' docstrings and the command line's help are made from it.

Each table maps an option to its description (Google style: the first sentence is the flag's help). The Muon
family's shared options are here; a schedule's options carry their own text (``Option.doc``, in
:mod:`dimuon.optim.schedules`); torch's AdamW and the ``torch_muon`` baseline have theirs, for the flags.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["ADAMW_OPTIONS", "CORE_OPTIONS", "TORCH_MUON_OPTIONS", "args_section"]

CORE_OPTIONS: dict[str, str] = {
    "params": "parameters, named parameters or parameter groups (see :func:`param_groups`); a group with "
    '``"algorithm": "adamw"`` is updated by AdamW.',
    "lr": "learning rate (shared by the AdamW groups unless a group sets its own); a number or a one-element "
    "Tensor (lets a compiled step follow an LR schedule without recompiling).",
    "momentum": "EMA momentum coefficient ``beta`` in [0, 1).",
    "nesterov": "use ``U = (1-beta) G + beta M`` instead of ``U = M``.",
    "weight_decay": "decoupled weight decay, ``W <- W (1 - lr wd)``.",
    "lr_scale": '``"match_rms_adamw"`` (0.2 sqrt(max(m, n))), ``"original"`` (sqrt(max(1, m/n))) or ``"none"``.',
    "ns_coefficients": '``"quintic"`` or ``"polar_express"``.',
    "ns_steps": "Newton-Schulz iterations.",
    "ns_dtype": "compute dtype of Newton-Schulz; ``None`` = fp32 on CPU, bf16 on accelerators.",
    "ns_algorithm": '``"standard"`` or ``"gram"`` (Gram Newton-Schulz on matrices with cols >= 2 rows).',
    "adamw_betas": 'AdamW\'s betas in the ``"adamw"`` groups.',
    "adamw_eps": 'AdamW\'s eps in the ``"adamw"`` groups.',
    "nonfinite": '``"raise"`` (default) or ``"skip"`` a step whose gradients hold inf/nan; either way no state '
    "tensor is touched by such a step. The ranks vote on the device (one 4-byte all-reduce where the parameters "
    'span the world); ``"skip"`` masks the step with the vote and reads nothing on the host (a skipped step still '
    "takes its slot in the schedule: ``t`` advances; ``skipped_steps`` is read when asked for or saved), "
    '``"raise"`` reads the vote once.',
    "refresh": 'spectral steps on sharded parameters: ``"owner"`` (default: one owner rank per matrix, buckets of '
    "same-shape matrices, one all-to-all there and one back per bucket; ``2/W`` of gather's bytes and no repeated "
    'Newton-Schulz) or ``"gather"`` (all-gather the momentum, every rank orthogonalizes every matrix).',
    "bucket_mb": "size of the communication buckets that overlap with Newton-Schulz, in MiB.",
    "comm_dtype": "dtype of the communicated momentum/directions (e.g. ``torch.bfloat16``); math stays in the "
    "compute dtype. None: the Newton-Schulz dtype where it is narrower than the momentum (bf16 on CUDA), which "
    "gives the same directions as fp32 payloads for half the bytes.",
    "process_group": "for plain parameters replicated across ranks (DDP): split the Newton-Schulz work over this "
    "group and broadcast the results. DTensor parameters need nothing.",
    "ns_compile": "run Newton-Schulz through ``torch.compile`` (the first step on each new matrix shape compiles, "
    "seconds each; same results within rounding).",
    "adamw_fused": "the AdamW groups' kernel: ``True`` fused, ``False`` foreach, ``None`` (default) fused wherever "
    "torch has a fused AdamW for the parameters' device and dtype.",
    "kernels": 'the momentum and weight-update passes: ``"auto"`` (default) one fused Triton launch per pass on CUDA '
    "where Triton imports (a RowNorm step reads and writes each element 9 times rather than 15), "
    '``"torch"`` the eager list ops everywhere, ``"triton"`` the fused kernels always (on CPU tensors through '
    "Triton's interpreter: slow, for checking them).",
    "replica_refresh": 'spectral steps of parameters that mesh dimensions replicate (HSDP): ``"repeat"`` (every '
    'replica refreshes every matrix; no bytes across replicas) or ``"split"`` (each matrix refreshed by one '
    "replica, its pieces broadcast to the others).",
    "engine": "where the direction maps run (tests); ``None`` picks the single-process or the sharded engine from "
    "the parameters.",
}

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
