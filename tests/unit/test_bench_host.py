"""``dimuon bench host``: its flags, its record, and what its call counter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dimuon.bench import host, host_probe, host_report
from dimuon.optim import build, devices
from dimuon.plan.host import host_model

QUICK = ["--quick", "--no-progress", "--width", "4", "--sharded-world", "0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--matrices", "7"], "--matrices must be positive multiples of 5"),
        (["--compile-modes", "fast"], r"--compile-modes must be from \['default', 'reduce-overhead'"),
        (["--compile-matrices", "40"], "--compile-matrices must be among --matrices"),
        (["--compile-modes", "default", "--matrices", "10"], "--compile-matrices must be among --matrices"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--optimizers", "--baselines"], "nothing to measure"),
        (["--sharded-world", "1"], r"--sharded-world must be world sizes >= 2 \(0: none\)"),
        (["--compile-backend", "eager", "--compile-modes", "reduce-overhead"], "takes --compile-modes default only"),
    ],
)
def test_bad_flags_are_named_with_what_they_allow(argv, message):
    with pytest.raises(ValueError, match=message):
        host.parse(argv)


def test_an_unknown_optimizer_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        host.parse(["--optimizers", "sgd"])
    assert exc.value.code == 2
    assert "sgd" in capsys.readouterr().err


def test_the_sharded_part_is_on_at_256_unless_turned_off():
    assert host.parse([]).sharded_world == (256,) and host.parse([]).sharded_refresh == "owner"
    off = [host.parse(["--sharded-world", *w]) for w in ((), ("0",))]
    assert all(not [p for p in host.phases_of(cfg) if p[2]] for cfg in off)


def test_compiled_rows_are_skip_on_inductor_unless_told_and_other_settings_are_refused(capsys):
    cfg = host.parse([])
    assert (cfg.compile_nonfinite, cfg.compile_backend) == ("skip", "inductor")
    assert host.parse(["--compile-nonfinite", "raise"]).compile_nonfinite == "raise"
    with pytest.raises(SystemExit):
        host.parse(["--compile-nonfinite", "ignore"])
    assert "ignore" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--compile-nonfinite must be skip or raise, got 'ignore'"):
        host.check_config(host.Config(compile_nonfinite="ignore"))  # type: ignore[arg-type]


def test_compile_sizes_are_not_checked_without_compiled_rows():
    assert host.parse(["--matrices", "10", "--compile-modes"]).compile_modes == ()


def test_main_reports_a_bad_flag_as_an_error_line(capsys):
    assert host.main(["--matrices", "12"]) == 2
    assert capsys.readouterr().err.startswith("dimuon bench host: error: --matrices")


def test_counter_counts_dimuon_frames_and_not_torchs():
    model = host.make_model(10, host.Config(width=4))
    adamw = build("adamw", model, lr=1e-3, foreach=True)
    muon = build("muon", model, lr=1e-3)
    with host_probe.accelerator_form():
        muon.step()  # the state made
        assert host_probe.dimuon_calls(muon.step) > 50
        assert host_probe.dimuon_calls(adamw.step) == 0
    # the counter is the package test, not a count of everything: torch's own files under torch's directory
    torch_dir = str(Path(torch.__file__).parent)
    assert host_probe.dimuon_calls(adamw.step, package_dir=torch_dir) > 0


def test_accelerator_form_switches_the_step_and_puts_it_back():
    cpu = torch.device("cpu")
    with host_probe.accelerator_form():
        assert devices.cpu_path(cpu) is False
    assert devices.cpu_path(cpu) is True


def test_quick_run_writes_a_record_with_every_row_and_kind(tmp_path, capsys):
    out, path = tmp_path / "host", tmp_path / "h.json"
    assert host.main([*QUICK, "--json", str(path), "--out", str(out)]) == 0
    record = json.loads(path.read_text())
    assert record["benchmark"] == "host" and record["complete"]
    machine = record["machine"]
    assert {"command", "torch", "cpu_model", "cpu_flags", "torch_threads"} <= set(machine)
    assert machine["torch_threads"] == 1 and record["op_us"] > 0
    names = {r["name"] for r in record["rows"]}
    assert names == {*host.OPTIMIZERS, *host.BASELINES}
    assert {r["matrices"] for r in record["rows"]} == {10, 20}
    rows = {(r["name"], r["matrices"]): r for r in record["rows"]}
    prm = rows["periodic_row_muon", 10]
    assert prm["period"] == 3 and set(prm["kinds"]) == {"spectral", "rownorm"}
    assert prm["kinds"]["rownorm"]["steps_per_period"] == 2
    assert set(rows["muon_bp", 20]["kinds"]) == {"spectral", "block"}
    for name in host.OPTIMIZERS:
        assert rows[name, 20]["calls_per_step"] > 0 and rows[name, 20]["ops_per_step"] > 0
    for name in ("adamw_foreach", "adamw_fused"):
        assert rows[name, 20]["calls_per_step"] == 0 and rows[name, 20]["host_ms"] > 0
    assert {p.name for p in out.iterdir()} == {"host.json", "host.md", "host.png"}
    assert "Made by `" in (out / "host.md").read_text()
    assert "PeriodicRowMuon" in capsys.readouterr().out


def _compiled_record(monkeypatch, nonfinite: str) -> tuple[dict, list[dict]]:
    """A quick run whose compiled rows run their step eagerly (``torch.compile`` replaced: the rows, the settings
    they were compiled with and the report's ratio column are checked here; the real compile under ``slow``)."""
    calls: list[dict] = []

    def recording(fn, **kwargs):
        calls.append({"nonfinite": fn.__self__.nonfinite, **kwargs})
        return fn

    monkeypatch.setattr(host.torch, "compile", recording)
    argv = [*QUICK, "--matrices", "10", "--baselines", "adamw_fused", "--compile-modes", "default"]
    return host.run(host.parse([*argv, "--compile-nonfinite", nonfinite])), calls


def test_compiled_rows_are_the_recommended_step_beside_their_eager_twins(monkeypatch):
    record, calls = _compiled_record(monkeypatch, "skip")
    assert [(c["nonfinite"], c["fullgraph"], c["mode"], c["backend"]) for c in calls] == [
        ("skip", True, "default", "inductor"),
        ("skip", True, "default", "inductor"),
        ("skip", True, "default", "inductor"),
        ("skip", False, "default", "inductor"),  # AdaptiveRowMuon reads its signals on the host
    ]
    rows = {r["name"]: r for r in record["rows"]}
    for name in host.OPTIMIZERS:
        compiled, twin = rows[f"{name}_compiled"], rows[f"{name}_skip"]
        assert compiled["twin"] == f"{name}_skip" and compiled["fullgraph"] == (name in host.FULLGRAPH)
        assert (twin["mode"], twin["nonfinite"], twin["optimizer"]) == ("eager", "skip", name)
        assert twin["ops_per_step"] > 0 and twin["host_ms"] > 0 and len(twin["period_means_ms"]) == 1
        ratio = host_report.x_eager(compiled, host_report.eager_twin(record, compiled))
        assert ratio == compiled["host_ms"] / twin["host_ms"]
    assert rows["muon_skip"]["label"] == "Muon (eager, skip)"
    assert rows["muon_compiled"]["label"] == "Muon (compiled, default, skip, fullgraph)"
    assert rows["adaptive_row_muon_compiled"]["label"] == "AdaptiveRowMuon (compiled, default, skip)"
    assert host_model(record, "test").terms  # the plan's fit reads the default rows as before
    header, body = host_report.compile_rows(record)
    cells = {line[0]: dict(zip(header, line)) for line in body}
    assert set(cells) == {f"{n}_compiled" for n in host.OPTIMIZERS}
    prm = cells["periodic_row_muon_compiled"]
    assert (prm["nonfinite"], prm["fullgraph"], prm["status"]) == ("skip", "yes", "ok")
    assert (
        prm["x eager"]
        == f"{rows['periodic_row_muon_compiled']['host_ms'] / rows['periodic_row_muon_skip']['host_ms']:.2f}"
    )
    assert prm["x eager by kind"].startswith("spectral ") and ", rownorm " in prm["x eager by kind"]
    assert cells["adaptive_row_muon_compiled"]["fullgraph"] == "no"
    assert "x eager" in host_report.render(record, markdown=True)


def test_compiled_rows_of_the_raise_setting_compile_without_fullgraph(monkeypatch):
    record, calls = _compiled_record(monkeypatch, "raise")
    assert {(c["nonfinite"], c["fullgraph"]) for c in calls} == {("raise", False)}
    names = {r["name"] for r in record["rows"]}
    assert {f"{n}_raise" for n in host.OPTIMIZERS} <= names


def test_a_compiled_row_that_fails_is_recorded_not_raised(monkeypatch):
    def broken(fn, **kwargs):
        def step():
            raise RuntimeError("cannot compile this step")

        return step

    monkeypatch.setattr(host.torch, "compile", broken)
    cfg = host.parse([*QUICK, "--optimizers", "muon", "--baselines", "--compile-modes", "default"])
    record = host.run(cfg)
    compiled = [r for r in record["rows"] if r["mode"] == "default"]
    assert [r["name"] for r in compiled] == ["muon_compiled"]
    assert compiled[0]["status"] == "failed" and "cannot compile this step" in compiled[0]["error"]
    assert compiled[0]["host_ms"] is None
    assert "cannot compile this step" in host_report.render(record)


def test_cudagraph_skips_are_counted_with_the_reason_inductor_logs():
    """Inductor's own call where it leaves a graph out of CUDA graphs: counted, its message kept; nothing outside."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to before the block")
    with host_probe.cudagraph_skips() as found:
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to after the block")
    assert found == {"count": 1, "reasons": ["skipping cudagraphs due to mutated inputs (2 instances)"]}


def test_reduce_overhead_rows_record_whether_their_graphs_ran_as_cuda_graphs(monkeypatch):
    """A reduce-overhead row records the graphs inductor ran without CUDA graphs and why (here a stand-in compile
    that skips one graph as inductor does); the other modes record nothing; the table says it per device."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    def skipping(fn, **kwargs):
        def step():
            if kwargs["mode"] == "reduce-overhead":
                log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to cpu device (arg0_1)")
            return fn()

        return step

    monkeypatch.setattr(host.torch, "compile", skipping)
    argv = [*QUICK, "--matrices", "10", "--optimizers", "muon", "--baselines"]
    record = host.run(host.parse([*argv, "--compile-modes", "default", "reduce-overhead"]))
    rows = {r["name"]: r for r in record["rows"]}
    reduce_overhead = rows["muon_compiled_reduce_overhead"]
    # one per warm-up step here: the warm-up period, then one that compiled nothing new
    assert reduce_overhead["cudagraph_skips"] == record["config"]["warmup"] + 1
    assert reduce_overhead["cudagraph_skip_reason"] == "skipping cudagraphs due to cpu device (arg0_1)"
    assert rows["muon_compiled"]["cudagraph_skips"] is None and rows["muon"]["cudagraph_skips"] is None
    header, body = host_report.compile_rows(record)
    cells = {line[0]: dict(zip(header, line)) for line in body}
    assert cells["muon_compiled_reduce_overhead"]["CUDA graphs"] == "no CUDA"  # inductor skips them all off a GPU
    assert cells["muon_compiled_reduce_overhead"]["error"].startswith("skipping cudagraphs due to cpu device")
    assert cells["muon_compiled"]["CUDA graphs"] == "-"
    on_gpu = {**record, "config": {**record["config"], "device": "cuda"}}
    assert host_report.cuda_graphs(on_gpu, reduce_overhead) == "2 skipped"
    assert host_report.cuda_graphs(on_gpu, {**reduce_overhead, "cudagraph_skips": 0}) == "all"


def test_a_compiled_row_warms_up_until_a_period_compiles_nothing(monkeypatch):
    """A stand-in compile that compiles a graph at each of its first calls (as torch recompiles while the state and
    the step counter settle): the row warms up past ``--warmup`` until a period compiles nothing new, counts every
    graph, and is counted and timed warm; one that keeps compiling stops after SETTLE_PERIODS periods."""
    from torch._dynamo.utils import counters

    def compiling(first_calls: int):
        def compile_(fn, **kwargs):
            calls = [0]

            def step():
                calls[0] += 1
                if calls[0] <= first_calls:
                    counters["stats"]["unique_graphs"] += 1
                return fn()

            return step

        return compile_

    argv = [*QUICK, "--matrices", "10", "--optimizers", "muon", "--baselines", "--compile-modes", "default"]
    monkeypatch.setattr(host.torch, "compile", compiling(3))
    row = next(r for r in host.run(host.parse(argv))["rows"] if r["name"] == "muon_compiled")
    assert row["graphs"] == 3 and row["status"] == "ok" and row["host_ms"] > 0
    monkeypatch.setattr(host.torch, "compile", compiling(100))
    row = next(r for r in host.run(host.parse(argv))["rows"] if r["name"] == "muon_compiled")
    assert row["graphs"] == 1 + host.SETTLE_PERIODS  # --warmup 1 period of one step, then the most it settles for


def test_sharded_rows_are_measured_counted_and_round_trip(tmp_path):
    """Rank 0 of 8 fake FSDP2 ranks at 10 matrices: every optimizer and torch's AdamW, counted and timed; the
    fake group gone after; the record as written is the record run returned, and its readers still read it."""
    out, path = tmp_path / "host", tmp_path / "h.json"
    argv = [*QUICK[:-2], "--matrices", "10", "--sharded-world", "8", "--json", str(path), "--out", str(out)]
    cfg = host.parse(argv)
    record = host.run(cfg, argv)
    host.write(record, cfg)
    assert not dist.is_initialized()
    written = json.loads(json.dumps(record))  # tuples as lists
    assert json.loads(path.read_text()) == written == json.loads((out / "host.json").read_text())
    sharded = {r["name"]: r for r in record["rows"] if "world" in r}
    names = [host_report.sharded_name(n, 8) for n in (*host.OPTIMIZERS, "adamw_foreach", "adamw_fused")]
    assert sorted(sharded) == sorted(names)  # torch.optim.Muon runs in one process only
    for name in host.OPTIMIZERS:
        row = sharded[host_report.sharded_name(name, 8)]
        assert row["status"] == "ok" and row["matrices"] == 10 and row["host_ms"] > 0
        assert row["calls_per_step"] > 0 and row["ops_per_step"] > 0
        assert (row["layout"], row["world"], row["rank"], row["refresh"]) == ("fsdp", 8, 0, "owner")
    assert set(sharded["periodic_row_muon [fsdp W=8]"]["kinds"]) == {"spectral", "rownorm"}
    assert sharded["adamw_foreach [fsdp W=8]"]["calls_per_step"] == 0
    one_process = [r for r in record["rows"] if "world" not in r]
    assert {r["name"] for r in one_process} == {*host.OPTIMIZERS, *host.BASELINES}
    assert host_model(record, "test").terms  # the plan's fit reads the one-process rows as before
    _, body = host_report.step_rows(record)
    adamw = {line[0]: line[-1] for line in body if line[0].startswith("torch AdamW (foreach)")}
    assert adamw == {"torch AdamW (foreach)": "1.00", "torch AdamW (foreach) [fsdp W=8]": "1.00"}
    text = (out / "host.md").read_text()
    assert "MuonBP [fsdp W=8]" in text and "fake process group" in text and "owner refresh" in text


@pytest.mark.slow
def test_compiled_muon_row_is_one_graph_on_dynamo():
    """The compiled Muon row as recorded, on dynamo's eager backend: ``fullgraph=True`` held, no graph break."""
    argv = [*QUICK, "--matrices", "10", "--optimizers", "muon", "--baselines", "--compile-modes", "default"]
    record = host.run(host.parse([*argv, "--compile-backend", "eager"]))
    rows = {r["name"]: r for r in record["rows"]}
    compiled = rows["muon_compiled"]
    assert compiled["status"] == "ok" and compiled["graph_breaks"] == 0 and compiled["graphs"] >= 1
    assert compiled["fullgraph"] and compiled["backend"] == "eager" and rows["muon_skip"]["host_ms"] > 0
