"""The ``dimuon bench host`` record as tables (plain text, Markdown) and a log-log plot of host ms per step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dimuon.bench.report import format_markdown_table, format_table
from dimuon.io import write_json_atomic, write_text_atomic

BASE = "adamw_foreach"
LAYOUT = "fsdp"  # the layout of the sharded rows


def sharded_name(name: str, world: int) -> str:
    """A sharded row's name or label: ``periodic_row_muon [fsdp W=256]``."""
    return f"{name} [{LAYOUT} W={world}]"


def base_of(rows: dict[str, dict[int, dict[str, Any]]], row: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The foreach AdamW rows that ``row`` is compared with: those of its own layout and world."""
    return rows.get(sharded_name(BASE, row["world"]) if "world" in row else BASE, {})


def _by_name(record: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in record["rows"]:
        out.setdefault(r["name"], {})[r["matrices"]] = r
    return out


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def step_rows(record: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per optimizer and step kind (and the period's mean): calls inside dimuon and host ms at every size, and the
    host time over torch's foreach AdamW (of the same layout) at each size."""
    sizes = sorted({r["matrices"] for r in record["rows"]})
    rows = _by_name(record)
    compared = any(base_of(rows, r) for r in record["rows"])
    header = ["optimizer", "step", *(f"calls {m}" for m in sizes), *(f"ms {m}" for m in sizes)]
    header += [f"x AdamW {m}" for m in sizes] if compared else []
    body = []
    for by_size in rows.values():
        first = next(iter(by_size.values()))
        base = base_of(rows, first)
        kinds = [k for r in by_size.values() for k in r["kinds"]]
        kinds = list(dict.fromkeys(kinds))
        lines = [("mean", None)] + ([(k, k) for k in kinds] if len(kinds) > 1 else [])
        for title, kind in lines:

            def pick(r: dict[str, Any] | None, key: str, kind: str | None = kind) -> float | None:
                if r is None or r["status"] != "ok":
                    return None
                return r[key] if kind is None else r["kinds"].get(kind, {}).get(key)

            cells = [_num(pick(by_size.get(m), "calls_per_step"), 0) for m in sizes]
            ms = [pick(by_size.get(m), "host_ms") for m in sizes]
            cells += [_num(v, 3) for v in ms]
            if compared:
                cells += [
                    _num(v / base[m]["host_ms"] if v is not None and base.get(m, {}).get("host_ms") else None, 2)
                    for v, m in zip(ms, sizes)
                ]
            label = first["label"] if title == "mean" else ""
            body.append([label, "period mean" if first["period"] > 1 and title == "mean" else title, *cells])
    return header, body


def eager_twin(record: dict[str, Any], row: dict[str, Any]) -> dict[str, Any] | None:
    """The eager row of the same setting timed in the same rounds as compiled ``row`` (None in a record made before
    compiled rows had one, or where it did not run)."""
    return next((r for r in record["rows"] if r["name"] == row.get("twin") and r["matrices"] == row["matrices"]), None)


def x_eager(row: dict[str, Any], twin: dict[str, Any] | None, kind: str | None = None) -> float | None:
    """Compiled ``row``'s host ms over its eager twin's: over the period, or of one step ``kind``."""
    if twin is None or row["status"] != "ok" or twin["status"] != "ok":
        return None
    ms = [r["host_ms"] if kind is None else r["kinds"].get(kind, {}).get("host_ms") for r in (row, twin)]
    return ms[0] / ms[1] if ms[0] is not None and ms[1] else None


def _by_kind(row: dict[str, Any], twin: dict[str, Any] | None) -> str:
    """``spectral 0.41, rownorm 0.35``: the ratio to the eager twin per step kind, where the step has several."""
    if len(row["kinds"]) < 2:
        return ""
    return ", ".join(f"{k} {_num(x_eager(row, twin, k))}" for k in row["kinds"])


def cuda_graphs(record: dict[str, Any], row: dict[str, Any]) -> str:
    """Whether a ``reduce-overhead`` row's graphs all run as CUDA graphs: ``all``, ``N skipped`` (the reason in the
    error column), ``no CUDA`` off a GPU (inductor skips every one there); ``-`` for the other modes."""
    skips = row.get("cudagraph_skips")
    if skips is None:
        return "-"
    if record["config"]["device"] != "cuda":
        return "no CUDA"
    return "all" if skips == 0 else f"{skips} skipped"


def compile_rows(record: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """What torch.compile did with every compiled row (nonfinite setting, fullgraph, status, first compiling step,
    graph breaks, CUDA graphs, error or why CUDA graphs were skipped) and its host ms over its eager twin's, timed in
    the same rounds (x eager)."""
    header = ["row", "matrices", "nonfinite", "fullgraph", "status", "first step s", "graph breaks", "graphs"]
    header += ["CUDA graphs", "ms", "eager ms", "x eager", "x eager by kind", "error"]
    body = []
    for r in record["rows"]:
        if r["mode"] == "eager":
            continue
        twin = eager_twin(record, r)
        first_s = None if r["first_step_ms"] is None else r["first_step_ms"] / 1e3
        error = r["error"] or r.get("cudagraph_skip_reason") or ""
        body.append(
            [
                r["name"],
                str(r["matrices"]),
                r.get("nonfinite") or "-",
                {True: "yes", False: "no"}.get(r.get("fullgraph"), "-"),
                r["status"],
                _num(first_s, 1),
                "-" if r["graph_breaks"] is None else str(r["graph_breaks"]),
                "-" if r["graphs"] is None else str(r["graphs"]),
                cuda_graphs(record, r),
                _num(r["host_ms"], 3),
                _num(twin["host_ms"] if twin else None, 3),
                _num(x_eager(r, twin)),
                _by_kind(r, twin),
                error.strip().splitlines()[0][:100] if error.strip() else "",
            ]
        )
    return header, body


def _title(record: dict[str, Any]) -> str:
    m, c = record["machine"], record["config"]
    threads = m["torch_threads"] if "torch_threads" in m else c["threads"]
    device = m.get("cuda") if c["device"] == "cuda" else f"{m['cpu_model']} ({', '.join(m['cpu_flags']) or 'no'} flags)"
    clock = "wall time" if c["device"] == "cuda" or c.get("clock") == "wall" else "thread CPU time"
    return (
        f"Host time per optimizer step ({clock}) in the accelerator form, {c['width']}-wide tiny matrices, "
        f"{threads} thread(s), {device}, torch {m['torch']}; one dispatched op {record['op_us']} us"
    )


def sharded_note(record: dict[str, Any]) -> str | None:
    """What the sharded rows are, where the record has any."""
    sharded = [r for r in record["rows"] if "world" in r]
    if not sharded:
        return None
    worlds = ", ".join(str(w) for w in sorted({r["world"] for r in sharded}))
    refresh = next((r["refresh"] for r in sharded if r.get("refresh")), None)
    return (
        f"Rows [{LAYOUT} W=N]: rank 0's step of N = {worlds} FSDP2 ranks (Shard(0) DTensor parameters), in one "
        "process on torch's fake process group (collectives move no data)"
        + (f", {refresh} refresh" if refresh else "")
        + "; their ms include the refresh's Newton-Schulz of the matrices rank 0 refreshes (tiny at this width)."
    )


def render(record: dict[str, Any], markdown: bool = False) -> str:
    """The record's tables: steps (calls and host ms per size) and, where compiled rows ran, compilation."""
    fmt: Callable[..., str] = format_markdown_table if markdown else format_table
    parts = [_title(record), fmt(*step_rows(record))]
    note = sharded_note(record)
    if note:
        parts.append(note)
    header, body = compile_rows(record)
    if body:  # names, settings, status and error read as text
        parts.append(
            fmt(header, body, [False, True, False, False, False, True, True, True, False, *[True] * 3, False, False])
        )
    if not record.get("complete", True):
        parts.append("(partial: the sizes measured so far)")
    return "\n\n".join(parts)


def plot(record: dict[str, Any], path: Path) -> None:
    """Host ms per step (period mean) against matrices, log-log, one line per row (a sharded row dash-dotted, a
    compiled row dashed with its ratio to its eager twin beside it, each in the colour of its one-process row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors: dict[str, str] = {}
    for by_size in _by_name(record).values():
        pts = sorted((m, r["host_ms"]) for m, r in by_size.items() if r["host_ms"] is not None)
        if not pts:
            continue
        first = next(iter(by_size.values()))
        style = "--" if first["mode"] != "eager" else (":" if not first["dimuon"] else "-")
        style = "-." if "world" in first else style
        marker = "s" if first["mode"] != "eager" else ("^" if "nonfinite" in first else "o")  # compiled, twin
        key = first.get("optimizer") or first["name"].split(" [")[0]  # sharded, compiled, twin: their row's
        color = colors.setdefault(key, f"C{len(colors) % 10}")
        ax.plot(*zip(*pts), style, marker=marker, color=color, label=first["label"])
        for m, r in by_size.items() if first["mode"] != "eager" else ():
            ratio = x_eager(r, eager_twin(record, r))
            if ratio is not None:
                ax.annotate(
                    f"x{ratio:.2f} eager",
                    (m, r["host_ms"]),
                    xytext=(4, 0),
                    textcoords="offset points",
                    fontsize=6,
                    color=color,
                    va="center",
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    sizes = sorted({r["matrices"] for r in record["rows"]})
    ax.set_xticks(sizes, [str(m) for m in sizes])
    ax.minorticks_off()
    ax.set_xlabel("Muon matrices")
    ax.set_ylabel("host ms per step (period mean)")
    ax.set_title("Host time per optimizer step, tiny matrices", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines, not over them
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_dir(record: dict[str, Any], out: Path) -> None:
    """host.json, host.md (the tables and the command that made them) and host.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "host.json", record)
    command = record.get("command") or record["machine"]["command"]
    write_text_atomic(out / "host.md", f"{render(record, markdown=True)}\n\nMade by `{command}`.\n")
    plot(record, out / "host.png")
