"""The optimizer benchmark end to end on a tiny DiT, plus the helpers it is built from (no timing asserts)."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dimuon.bench import optimizer as bench
from dimuon.bench.peers import PEERS, Peer
from dimuon.bench.report import format_markdown_table, format_table
from dimuon.bench.timing import Candidate, interleave
from dimuon.io import write_json_atomic
from dimuon.optim import linalg

TINY = [
    "--depth",
    "1",
    "--hidden-size",
    "64",
    "--num-heads",
    "2",
    "--input-size",
    "8",
    "--num-classes",
    "10",
    "--repeats",
    "1",
    "--warmup",
    "0",
    "--ns-repeats",
    "1",
    "--no-progress",
    "--threads",
    "1",
]
# torch.optim.Muon runs everywhere; dtensor-muon never on a CPU (not installed, no Triton, or no CUDA).
PEERS_HERE = ["--peers", "torch_muon", "dtensor_muon"]


def test_end_to_end_tiny_dit_writes_every_optimizer(tmp_path, capsys):
    out = tmp_path / "bench" / "optimizer.json"
    threads = torch.get_num_threads()
    assert bench.main([*TINY, *PEERS_HERE, "--out", str(out), "--markdown", str(tmp_path / "o.md")]) == 0
    assert torch.get_num_threads() == threads  # --threads holds for the run only
    record = json.loads(out.read_text())
    # the eager-kernel rows differ from the others only on CUDA: left out here
    assert set(record["optimizers"]) == {*bench.OPTIMIZERS, "torch_muon"} - set(bench.FUSED_ONLY)
    torch_muon, dtensor_muon = record["peers"]["torch_muon"], record["peers"]["dtensor_muon"]
    assert torch_muon["runnable"] and torch_muon["version"] == torch.__version__
    assert record["optimizers"]["torch_muon"]["ns_dtype"] == "bfloat16" and record["optimizers"]["torch_muon"]["peer"]
    assert record["optimizers"]["muon"]["ns_dtype"] == "float32" and record["optimizers"]["muon"]["version"]
    assert not dtensor_muon["runnable"] and dtensor_muon["reason"].startswith("cannot run here: ")
    for name, r in record["optimizers"].items():
        assert r["median_ms"] > 0 and r["min_ms"] > 0, name
        assert r["ratio_to_adamw"] > 0 and r["ratio_to_reference"] > 0 and r["ratio_to_muon"] > 0, name
        assert r["first_ms"] is None, name  # --warmup 0: no first step apart
    assert record["optimizers"]["muon"]["ratio_to_muon"] == 1.0
    assert record["optimizers"]["muon_compiled"]["label"] == "dimuon Muon (standard NS, compiled)"
    assert record["optimizers"]["muon_per_head"]["label"].endswith("per head: qkv rows, proj columns, H=2)")
    assert record["ns_flop_rate"]["dtype"] == "float32" and record["machine"]["gpu"] is None
    assert record["optimizers"]["periodic_row_muon"]["calls_per_sample"] == 3
    assert record["optimizers"]["muon_bp"]["calls_per_sample"] == 5
    for algorithm in linalg.NS_ALGORITHMS:
        ns = record["ns_flop_rate"][algorithm]
        assert ns["gflop"] > 0 and ns["ns_ms"] > 0 and ns["bmm_ms"] > 0 and ns["ratio"] > 0
    assert "targets" not in record  # the project's own targets: scripts/optimizer_targets.py
    # The RowNorm and block rows time steps of their kind only (their spectral first step is taken untimed).
    assert record["optimizers"]["rownorm_step"]["calls_per_sample"] == 1
    assert record["optimizers"]["block_step"]["label"] == "dimuon MuonBP, block steps only"
    machine = record["machine"]
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == 1 and machine["cpu_model"]
    assert record["model"]["muon_matrices"] == 7  # qkv, proj, fc1, fc2, adaLN, t-MLP 2nd linear, final adaLN
    printed = capsys.readouterr().out
    assert "dimuon Muon (Gram NS)" in printed and "Targets:" not in printed
    assert dtensor_muon["reason"] in printed and "bfloat16" in printed
    assert "| dimuon Muon (Gram NS) |" in (tmp_path / "o.md").read_text()


def test_skip_and_per_optimizer_repeats(tmp_path):
    out = tmp_path / "o.json"
    argv = [
        *TINY,
        "--skip",
        "torch_muon",
        "adamw_fused",
        "muon_compiled",
        "--repeats-of",
        "muon=2",
        "--no-ns-rate",
        "--out",
        str(out),
        *PEERS_HERE,
    ]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert "torch_muon" not in record["optimizers"] and "adamw_fused" not in record["optimizers"]
    assert record["optimizers"]["muon"]["repeats"] == 2
    assert record["ns_flop_rate"] is None


def _peer(key: str, distribution: str, builder) -> Peer:
    return Peer(key, f"{key} peer", distribution, "torch", "bfloat16", "test", "test", builder, "0")


def test_a_missing_peer_and_a_failing_peer_are_rows_and_the_others_still_run(tmp_path, monkeypatch):
    class Failing:
        def step(self):
            raise RuntimeError("only 1-D meshes")

    monkeypatch.setitem(PEERS, "ghost", _peer("ghost", "dimuon-no-such-package", None))
    monkeypatch.setitem(PEERS, "failing", _peer("failing", "torch", lambda mod, muon, rest, lr: Failing()))
    out = tmp_path / "o.json"
    argv = [
        *TINY,
        "--skip",
        "adamw_fused",
        "muon_gram",
        "muon_compiled",
        "muon_bf16",
        "muon_gram_bf16",
        "muon_bp",
        "periodic_row_muon",
        "reference_muon",
        "muon_per_head",
        "rownorm_step",
        "block_step",
        "--peers",
        "ghost",
        "failing",
        "torch_muon",
        "--no-ns-rate",
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert set(record["optimizers"]) == {"adamw_foreach", "muon", "torch_muon"}
    assert record["peers"]["ghost"]["reason"] == (
        "cannot run here: dimuon-no-such-package is not installed (pip install 'dimuon[peers]')"
    )
    assert record["peers"]["failing"]["reason"] == "cannot run here: its step fails: RuntimeError: only 1-D meshes"
    assert record["config"]["peers"] == ["ghost", "failing", "torch_muon"]


def test_no_peers_and_bad_peer_names(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert (
        bench.main([*TINY, "--no-peers", "--skip", "muon_gram", "muon_compiled", "--no-ns-rate", "--out", str(out)])
        == 0
    )
    record = json.loads(out.read_text())
    assert record["peers"] == {} and not any(r["peer"] for r in record["optimizers"].values())
    assert bench.main(["--peers", "sgd"]) == 2
    assert "--peers got unknown peer(s) ['sgd']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "DiT-Q/2"], "--model must be one of: DiT-T/2, "),
        (["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
        (["--repeats-of", "muon=0"], "--repeats-of expects NAME=N with NAME in "),
        (["--warmup-of", "muon=-1"], "--warmup-of expects NAME=N with NAME in "),
        (["--ns-repeats", "0"], "--ns-repeats must be an integer >= 1, got 0"),
        (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
        (["--k", "0"], "--k must be an integer >= 1, got 0"),
        (["--period", "0"], "--period must be an integer >= 1, got 0"),
        (["--bp-blocks", "0"], "--bp-blocks must be an integer >= 1, got 0"),
        (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
        (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    ],
)
def test_bad_values_stop_at_start_up_naming_the_flag(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr(bench, "build_model", lambda cfg: pytest.fail("built a model"))
    out = tmp_path / "o.json"
    assert bench.main([*flags, "--no-peers", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"dimuon bench optimizer: {message}")
    assert not out.exists()


def test_the_load_average_at_end_is_read_at_the_end(tmp_path, monkeypatch):
    reads = iter(range(1, 1000))
    monkeypatch.setattr("os.getloadavg", lambda: (float(next(reads)),) * 3)
    out = tmp_path / "r.json"
    only = ["--skip", *(n for n in bench.OPTIMIZERS if n not in ("adamw_foreach", "muon")), "--no-peers"]
    assert bench.main([*TINY, *only, "--no-ns-rate", "--out", str(out)]) == 0
    machine = json.loads(out.read_text())["machine"]
    last = next(reads) - 1  # the number of reads made
    assert machine["load_average_at_start"] == [1.0] * 3 and machine["load_average"] == [float(last)] * 3 and last > 1
    assert f"load average [1.0, 1.0, 1.0] at start, [{last}.0, {last}.0, {last}.0] at end" in bench.render(
        json.loads(out.read_text())
    )


def test_bad_override_names_the_flag():
    with pytest.raises(ValueError, match="--repeats-of expects NAME=N"):
        bench.parse_overrides(["sgd=3"], "--repeats-of")


def test_engine_batches_stack_oriented_shapes():
    cfg = bench.Config(depth=2, hidden_size=32, num_heads=2, num_classes=4)
    batches = sorted(bench.engine_batches(bench.build_model(cfg)))
    # (D, D): 2 proj + t-MLP; (D, 2D): final adaLN; (D, 3D): qkv; (D, 4D): fc1 + fc2; (D, 6D): adaLN.
    assert batches == [(1, 32, 64), (2, 32, 96), (2, 32, 192), (3, 32, 32), (4, 32, 128)]


class _CountProducts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.products: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("bmm", "baddbmm", "mm", "addmm"):
            a, b = (args[0], args[1]) if name in ("bmm", "mm") else (args[1], args[2])
            self.products.append((a.shape[-2], a.shape[-1], b.shape[-1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (16, 24), (20, 20)])
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("restart", [0, 1, 2, 3])
@pytest.mark.parametrize("steps", [1, 5])
def test_product_count_matches_what_newton_schulz_issues(shape, algorithm, restart, steps):
    with _CountProducts() as counter:
        linalg.newton_schulz(torch.randn(2, *shape), steps=steps, algorithm=algorithm, gram_restart_every=restart)
    expected = linalg.newton_schulz_products(*shape, steps=steps, algorithm=algorithm, gram_restart_every=restart)
    # A tall input's last product may be issued transposed: compare the sizes, which fix the FLOPs.
    assert sorted(tuple(sorted(p)) for p in counter.products) == sorted(tuple(sorted(p)) for p in expected)


def test_interleave_takes_samples_round_robin():
    order: list[str] = []
    cands = [
        Candidate("a", lambda: order.append("a"), repeats=2, warmup=1),
        Candidate("b", lambda: order.append("b"), repeats=1, warmup=0, calls=3),
    ]
    timings = interleave(cands, progress=False)
    assert order == ["a", "a", "b", "b", "b", "a"]
    assert len(timings["a"].samples) == 2 and len(timings["b"].samples) == 1
    assert timings["b"].to_dict()["calls_per_sample"] == 3


def test_interleave_hands_over_every_round_so_a_stopped_run_keeps_its_rows():
    rounds: list[dict[str, int]] = []
    cands = [
        Candidate("a", lambda: None, repeats=3, warmup=1),
        Candidate("b", lambda: None, repeats=1, warmup=1),
    ]
    interleave(cands, progress=False, on_round=lambda done: rounds.append({k: len(t.samples) for k, t in done.items()}))
    assert rounds == [{"a": 1, "b": 1}, {"a": 2, "b": 1}, {"a": 3, "b": 1}]


def test_the_benchmark_writes_its_rows_after_every_round_and_marks_them_partial(tmp_path, monkeypatch):
    """What a time limit leaves in --out: the record of the rounds done, ``partial`` until the run completes."""
    out = tmp_path / "r.json"
    seen: list[tuple[bool, int]] = []
    real_write = bench.write_json_atomic

    def spy(path, record):
        seen.append((record["partial"], len(record["optimizers"])))
        return real_write(path, record)

    monkeypatch.setattr(bench, "write_json_atomic", spy)
    flags = ["--depth", "1", "--hidden-size", "64", "--num-heads", "2", "--input-size", "8", "--num-classes", "10"]
    only = ["--skip", *(n for n in bench.OPTIMIZERS if n not in ("adamw_foreach", "muon")), "--no-peers"]
    assert bench.main([*flags, *only, "--repeats", "2", "--warmup", "0", "--no-ns-rate", "--out", str(out)]) == 0
    assert seen == [(True, 2), (True, 2), (False, 2)]
    assert json.loads(out.read_text())["partial"] is False


def test_report_helpers(tmp_path):
    path = write_json_atomic(tmp_path / "x" / "r.json", {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert list(path.parent.iterdir()) == [path]  # no temporary left behind
    table = format_table(["name", "ms"], [["muon", "1.5"], ["adamw", "10.25"]])
    assert table.splitlines()[2] == "muon     1.5"
    assert format_markdown_table(["name", "ms"], [["muon", 1.5]]).splitlines() == [
        "| name | ms |",
        "| --- | ---: |",
        "| muon | 1.5 |",
    ]


def test_the_first_warm_up_sample_is_kept_apart_and_sync_brackets_every_sample():
    events: list[str] = []
    cands = [Candidate("a", lambda: events.append("a"), repeats=2, warmup=2)]
    timings = interleave(cands, progress=False, sync=lambda: events.append("sync"))
    assert events == ["sync", "a", "sync"] * 4  # 2 warm-up samples, then 2 timed ones
    assert timings["a"].first is not None and timings["a"].to_dict()["first_ms"] == 1e3 * timings["a"].first
    assert len(timings["a"].samples) == 2


def test_a_cuda_device_without_cuda_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda", "--no-progress"]) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_every_row_runs_in_bf16_with_the_gpu_recorded(tmp_path):
    out = tmp_path / "o.json"
    assert bench.main([*TINY, "--device", "cuda", "--warmup", "1", "--peers", "torch_muon", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["optimizers"]) == {*bench.OPTIMIZERS, "torch_muon"}
    assert record["optimizers"]["muon"]["ns_dtype"] == "bfloat16" and record["ns_flop_rate"]["dtype"] == "bfloat16"
    assert all(r["first_ms"] > 0 for r in record["optimizers"].values())
    assert record["machine"]["gpu"]["name"] and record["machine"]["gpu"]["cuda"]


def test_the_rownorm_and_block_rows_time_steps_of_their_kind_only():
    from dimuon.optim.schedules import StepKind

    cfg = bench.Config(model="DiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=8, num_classes=10)
    model = bench.build_model(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    steps = bench.make_steps(cfg, model, ["rownorm_step", "block_step"])
    for name, kind in (("rownorm_step", StepKind.ROWNORM), ("block_step", StepKind.BLOCK)):
        step, calls = steps[name]
        opt = step.__self__
        assert calls == 1 and opt.param_groups[0]["step"] == 1, name  # the spectral first step was taken
        for _ in range(3):
            assert {k for k in opt.step_kinds() if k is not None} == {kind}, name
            step()


def test_a_table_takes_one_alignment_per_column() -> None:
    from dimuon.bench.report import format_markdown_table, format_table

    assert format_markdown_table(["a", "b"], [[1, 2]]).splitlines()[1] == "| --- | ---: |"
    for render in (format_table, format_markdown_table):
        with pytest.raises(ValueError, match=r"2 column alignments for 3 columns"):
            render(["a", "b", "c"], [[1, 2, 3]], right=[False, True])  # Markdown would draw no table
