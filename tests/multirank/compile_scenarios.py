"""Rank-side programs of the compiled-step tests on a mesh: the same seeded FSDP2 model and optimizer stepped eagerly
and with ``torch.compile(opt.step)`` (dynamo's graphs run by a counting backend, the traced ops run as they are),
the break reasons, the graphs compiled per step, and, on warm steps, the ops that ran outside every graph and
every collective (the profiler, with ranges opened around the collectives' own Python frames)."""

from __future__ import annotations

import collections
import re
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from .scenarios import batch, make

GRAPH, COLLECTIVE = "compiled graph", "collective"
COLLECTIVES_FILE = "optim/distributed/collectives.py"
# What moves no data: views, metadata and allocations (the glue of the Python between graphs).
METADATA = {
    f"aten::{op}"
    for op in [
        *("alias", "as_strided", "chunk", "detach", "empty", "empty_like", "empty_strided", "expand", "lift_fresh"),
        *("mT", "narrow", "new_empty", "permute", "promote_types", "result_type", "select", "slice", "split"),
        *("split_with_sizes", "squeeze", "t", "transpose", "unbind", "unsqueeze", "view", "view_as", "_unsafe_view"),
        "_reshape_alias",
    ]
}
COPY_IF_NEEDED = frozenset({"aten::to", "aten::contiguous", "aten::reshape"})  # metadata unless a copy ran inside
DISABLED = "Skip inlining `torch.compiler.disable()`d function"


class _CollectiveRanges:
    """A ``sys.setprofile`` hook opening a profiler range for every outermost Python frame of the collectives
    module (its calls run as Python under a compiled step), so that the ops they run are told apart."""

    def __init__(self) -> None:
        self.open: list[Any] = []
        self.depth = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return") or not frame.f_code.co_filename.endswith(COLLECTIVES_FILE):
            return
        if event == "call":
            self.depth += 1
            if self.depth == 1:
                self.open.append(record_function(COLLECTIVE).__enter__())
        else:
            self.depth -= 1
            if self.depth == 0:
                self.open.pop().__exit__(None, None, None)


def _outside_ops(prof: profile) -> dict[str, int]:
    """The ops of this thread that moved data outside every compiled graph and every collective."""
    events = prof.events()
    threads = {e.thread for e in events if e.name == GRAPH}
    out: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.thread not in threads or not e.name.startswith("aten::") or e.name in METADATA:
            continue
        if e.name in COPY_IF_NEEDED and not e.cpu_children:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in (GRAPH, COLLECTIVE) and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out[e.name] += 1
    return dict(out)


def _reason(text: str) -> str:
    """A break reason in one line: the function a ``torch.compiler.disable`` boundary names, else its first line."""
    first = text.split("\n")[0]
    found = re.search(r"<function ([\w.<>]+) at 0x", text)
    return found.group(1) if first.startswith(DISABLED) and found else first


def _profiled(step: Any) -> dict[str, int]:
    """One call of ``step`` under the profiler: its ops outside graphs and collectives."""
    ranges = _CollectiveRanges()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sys.setprofile(ranges)
        try:
            step()
        finally:
            sys.setprofile(None)
    return _outside_ops(prof)


NAN_STEP = 3


def _set_grads(model: nn.Module, rank: int, t: int) -> None:
    """Step ``t``'s gradients on this rank, the same in both runs whatever the weights (a difference does not feed
    back through the forward), with a NaN on the last rank at step 3 (a step every rank skips)."""
    g = torch.Generator().manual_seed(1000 * t + rank)
    for p in model.parameters():
        local = p.grad.to_local()
        local.copy_(torch.randn(local.shape, generator=g))
        if t == NAN_STEP and rank == 1 and local.numel():
            local.view(-1)[0] = float("nan")


def _run(model_name: str, name: str, opts: dict, steps: int, backend: str | None, profiled: int) -> dict:
    """``steps`` steps of the seeded model on set gradients, the first eager (it makes the state), the others
    compiled if a ``backend`` is given (``"eager"``: dynamo's graphs run as traced; ``"inductor"``); the last
    ``profiled`` ones under the profiler."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs: list[int] = []  # nodes of each graph compiled
    seen: list[int] = []  # graphs compiled by the end of each step
    runs = [0] * steps  # graphs run in each step
    outside: list[dict[str, int]] = []
    seconds: list[float] = []

    def counting(gm: torch.fx.GraphModule, inputs: list) -> Any:
        graphs.append(len(gm.graph.nodes))
        forward = gm.forward if backend == "eager" else torch._inductor.compile(gm, inputs)

        def run(*args: Any) -> Any:
            runs[len(seen)] += 1
            with record_function(GRAPH):
                return forward(*args)

        return run

    rank = torch.distributed.get_rank()
    model, opt = make(model_name, name, dict(opts, nonfinite="skip"), torch.distributed.get_world_size())
    x, y = batch(model_name, 0)
    nn.functional.mse_loss(model(x), y).backward()  # the gradients' DTensors, refilled at every step
    step = torch.compile(opt.step, backend=counting) if backend else opt.step
    for t in range(steps):
        _set_grads(model, rank, t)
        start = time.perf_counter()
        if t == 0:
            opt.step()
        elif t >= steps - profiled:
            outside.append(_profiled(step))
        else:
            step()
        seconds.append(time.perf_counter() - start)
        seen.append(len(graphs))
    reasons: collections.Counter[str] = collections.Counter()
    for text, count in counters["graph_break"].items():
        reasons[_reason(text)] += count
    weights = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    comm = {kind: (v["calls"], v["bytes"]) for kind, v in opt.comm_stats().items()}
    return {
        "weights": weights,
        "comm": comm,
        "graphs": seen,
        "reasons": dict(reasons),
        "outside": outside,
        "seconds": seconds,
        "runs": runs,
    }


def compiled_and_eager(
    rank: int, world: int, model: str, name: str, opts: dict, steps: int, profiled: int, backend: str = "eager"
) -> dict:
    """Per rank: the eager and the compiled run of the same steps (see :func:`_run`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _run(model, name, opts, steps, None, profiled)
        compiled = _run(model, name, opts, steps, backend, profiled)
    return {"eager": eager, "compiled": compiled}
