"""The docs do what they say: their python blocks run, their relative links resolve, their dimuon commands parse.

- Python blocks: every ```python block of the pages in ``PYTHON_PAGES`` (README.md, docs/api.md) is a test case
  ``page:line``, run in a fresh process in a temporary directory, as the marker comment before it says
  (``<!-- test: context=training | ranks=2 | file=PATH | skip=REASON | cuda -->``; an unknown marker fails).
- Links: every relative link and image of README.md, CHANGELOG.md, CONTRIBUTING.md and docs/**/*.md names an
  existing file, and its ``#anchor`` a heading of the Markdown file it points to (GitHub's slugs). Links in code
  blocks and code spans are not links; http(s) and mailto links are not checked.
- Commands: every ``dimuon ...`` command of those pages parses with ``dimuon.cli.parse``: the lines of bash, sh,
  shell and console blocks (continuations joined, split at ``&&``, ``;``, ``|``, comments, prompts and
  environment assignments dropped; ``torchrun ... -m dimuon.cli``, ``python -m dimuon.cli`` and ``python -m
  dimuon.bench.X`` too) and inline code spans that start with ``dimuon ``. Spans holding a glob (``*``), an
  ellipsis (``...``) or a ``<placeholder>`` mention a family of commands and are not checked; a span that is a
  command's name alone (``dimuon sample``) only has to name one; a span quoting a message (``dimuon train:
  error: ...``) is output. Values in capitals or shell variables (RUN, N, $NODES) are placeholders. Commands
  are checked as on a machine with CUDA, under torchrun's environment where torchrun launches them, and
  ``--resume RUN`` is not read.

Run: ``python -m pytest -q tests/unit/test_docs.py`` (``-k commands``, ``-k links`` or ``-k README.md:`` for one
part; ``-m "not multirank"`` leaves out the blocks on several processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests import doc_blocks as db


def _python_block_cases() -> list[object]:
    """One case per python block of the run pages (a page not present: one skipped case saying so)."""
    cases: list[object] = []
    for page in db.PYTHON_PAGES:
        path = db.REPO / page
        if not path.is_file():
            cases.append(pytest.param(None, id=f"{page}:absent", marks=pytest.mark.skip(reason=f"no {page}")))
            continue
        for block in db.python_blocks(path.read_text(encoding="utf-8"), page):
            try:
                several = db.parse_markers(block.marker, block.id).ranks > 1
            except db.MarkerError:
                several = False  # the case fails, naming the marker
            cases.append(pytest.param(block, id=block.id, marks=[pytest.mark.multirank] if several else []))
    return cases


@pytest.mark.parametrize("block", _python_block_cases())
def test_python_block(block: db.Block, tmp_path: Path) -> None:
    try:
        markers = db.parse_markers(block.marker, block.id)
    except db.MarkerError as exc:
        pytest.fail(str(exc), pytrace=False)
    if markers.skip:
        pytest.skip(f"{block.id}: {markers.skip}")
    if markers.cuda and not torch.cuda.is_available():
        pytest.skip(f"{block.id}: needs CUDA")
    failure = db.verbatim_failure(block, str(markers.file)) if markers.file else db.run_block(block, markers, tmp_path)
    if failure:
        pytest.fail(failure, pytrace=False)


@pytest.mark.parametrize("page", [p for p in db.PYTHON_PAGES if (db.REPO / p).is_file()])
def test_markers_sit_on_python_blocks(page: str) -> None:
    misplaced = db.misplaced_markers((db.REPO / page).read_text(encoding="utf-8"), page)
    assert not misplaced, "\n".join(misplaced)


@pytest.mark.parametrize("page", db.doc_pages())
def test_links(page: str) -> None:
    failures = db.link_failures(page)
    assert not failures, "links that lead nowhere:\n" + "\n".join(failures)


@pytest.mark.parametrize("page", db.doc_pages())
def test_tables(page: str) -> None:
    failures = db.table_failures(page)
    assert not failures, "tables that do not render:\n" + "\n".join(failures)


@pytest.mark.parametrize("page", db.doc_pages())
def test_commands(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dimuon command of the page parses with ``dimuon.cli.parse``, in this process. Inline spans holding a
    glob (``dimuon train --optim.*``), an ellipsis (``...``) or a ``<placeholder>`` are not commands and are left
    out; the module's docstring says what else counts as one."""
    monkeypatch.chdir(tmp_path)  # a relative path in a command never meets this checkout's files
    failures = db.command_failures(page)
    assert not failures, "commands that do not parse:\n" + "\n".join(failures)


# ------------------------------------------------------------------------------------------------ the checks


def test_slugs_follow_githubs_rules() -> None:
    assert db.slug("Parallelism: HSDP, tensor parallel, FSDP x TP") == "parallelism-hsdp-tensor-parallel-fsdp-x-tp"
    assert db.slug("`dimuon train` and `--resume`") == "dimuon-train-and---resume"
    assert db.slug("  Results at a glance (CPU) ") == "results-at-a-glance-cpu"
    assert db.slug("What [docs/x.md](docs/x.md) says: ns_steps") == "what-docsxmd-says-ns_steps"
    assert db.slug("Über 2.13") == "über-213"


def test_anchors_number_repeated_headings_and_skip_code() -> None:
    page = "# Title\n\n## Setup\n\n```bash\n# not a heading\n```\n\n## Setup\n\nUnderlined\n---\n\n<a id='here'></a>\n"
    assert db.anchors(page) == {"title", "setup", "setup-1", "underlined", "here"}


def _write(root: Path, page: str, text: str) -> str:
    (root / page).parent.mkdir(parents=True, exist_ok=True)
    (root / page).write_text(text, encoding="utf-8")
    return page


def test_tables_with_a_short_rule_or_a_ragged_row_are_found(tmp_path: Path) -> None:
    good = "| `b | c` | d \\| e |\n| --- | ---: |\n| 1 | 2 |\n"  # a pipe in code or escaped splits nothing
    bad = "| a | b | c |\n| --- | ---: |\n| 1 | 2 | 3 |\n\n| x | y |\n| --- | --- |\n| 1 | 2 | 3 |\n"
    fenced = "```\n| a | b |\n| --- |\n```\n"
    _write(tmp_path, "good.md", good + fenced)
    _write(tmp_path, "bad.md", bad)
    assert db.table_failures("good.md", tmp_path) == []
    assert db.table_failures("bad.md", tmp_path) == [
        "bad.md:2: the table's rule has 2 cells, its header 3",
        "bad.md:7: the table's row has 3 cells, its header 2",
    ]


def test_links_that_lead_nowhere_are_found(tmp_path: Path) -> None:
    _write(tmp_path, "docs/other.md", "# Other page\n\n## A part\n")
    _write(tmp_path, "docs/pic.png", "")
    page = _write(
        tmp_path,
        "docs/page.md",
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#a-part) [ok](#page) ![ok](pic.png) [ok](../docs/other.md#other-page)\n"
        "[missing](nothere.md) [bad anchor](other.md#no-part)\n"
        "[bad here](#nowhere) ![missing image](img.png)\n"
        "[web](https://example.com/x.md) [mail](mailto:a@b.c) `[span](gone.md)`\n"
        "```md\n[in a block](gone.md)\n```\n"
        "[ref]: also-gone.md\n",
    )
    assert db.link_failures(page, root=tmp_path) == [
        "docs/page.md:4: nothere.md: no such file docs/nothere.md",
        "docs/page.md:4: other.md#no-part: no heading of docs/other.md has the anchor #no-part",
        "docs/page.md:5: #nowhere: no heading of docs/page.md has the anchor #nowhere",
        "docs/page.md:5: img.png: no such file docs/img.png",
        "docs/page.md:10: also-gone.md: no such file docs/also-gone.md",
    ]


def test_commands_are_read_as_the_shell_reads_them() -> None:
    page = (
        "Run `dimuon train --lr 1e-3` or `dimuon bench step`; not `dimuon train --optim.*`, `dimuon eval ...`,\n"
        "`dimuon <command> --help` nor the message `dimuon train: error: bad`.\n\n"
        "```bash\n"
        "OMP_NUM_THREADS=1 dimuon train --steps 10 \\\n"
        "    --out runs/x && dimuon eval --run runs/x  # then evaluate\n"
        "$ python -m dimuon.bench.optimizer --no-peers > out.txt 2>&1\n"
        "torchrun --nproc-per-node 4 -m dimuon.cli bench comm --mesh hsdp2x2 | tee log\n"
        "pip install dimuon  # not a dimuon command\n"
        "```\n\n"
        "```console\n$ dimuon groups --model DiT-S/2\nmuon: 10 tensors\n```\n\n"
        "```text\ndimuon train --nope\n```\n"
    )
    got = [(c.line, c.argv, c.torchrun, c.name_only) for c in db.page_commands(page, "p.md")]
    assert got == [
        (1, ("train", "--lr", "1e-3"), 0, False),
        (1, ("bench", "step"), 0, True),
        (5, ("train", "--steps", "10", "--out", "runs/x"), 0, False),
        (5, ("eval", "--run", "runs/x"), 0, False),
        (7, ("bench", "optimizer", "--no-peers"), 0, False),
        (8, ("bench", "comm", "--mesh", "hsdp2x2"), 4, False),
        (13, ("groups", "--model", "DiT-S/2"), 0, False),
    ]


def test_commands_that_do_not_parse_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    page = _write(
        tmp_path,
        "page.md",
        "```bash\n"
        "dimuon train --steps N --out DIR --resume RUN\n"  # placeholders; the run is not read
        "dimuon train --learning-rate 0.1\n"  # no such flag
        "dimuon bench optimizer --peers sgd\n"  # a value the start-up check refuses
        "torchrun --nproc-per-node 2 -m dimuon.cli bench comm --device cuda --world 2\n"  # as under torchrun
        "dimuon bench nosuch\n"
        "dimuon train --resume <run>\n"
        "python -m dimuon.nosuch --x\n"
        "```\n"
        "`dimuon sample` and `dimuon sample --n`\n",
    )
    failures = db.command_failures(page, root=tmp_path)
    assert [f.split(": ", 1)[0] for f in failures] == [
        "page.md:3",
        "page.md:4",
        "page.md:6",
        "page.md:7",
        "page.md:8",
        "page.md:10",
    ], "\n".join(failures)
    assert "--learning-rate" in failures[0] and "--peers got unknown peer" in failures[1]
    assert "placeholder <run>" in failures[3] and "not a dimuon command" in failures[4]
    assert "Missing value" in failures[5] or "--n" in failures[5]


def test_markers_are_read_and_unknown_ones_named() -> None:
    assert db.parse_markers(None, "p.md:1") == db.Markers()
    assert db.parse_markers("<!-- test: context=training ranks=2 -->", "p") == db.Markers(context="training", ranks=2)
    assert db.parse_markers("<!-- test: skip=needs torchtitan 0.3 -->", "p").skip == "needs torchtitan 0.3"
    assert db.parse_markers("<!-- test: file=examples/x.py -->", "p").file == "examples/x.py"
    assert db.parse_markers("<!-- test: cuda -->", "p").cuda
    for bad in ("<!-- test: context=eval -->", "<!-- test: ranks=1 -->", "<!-- test: gpu -->", "<!-- test -->"):
        with pytest.raises(db.MarkerError, match=r"README\.md:7: .*context=training, ranks=N"):
            db.parse_markers(bad, "README.md:7")
    page = "<!-- test: cuda -->\n```python\nx = 1\n```\n\n<!-- test: cuda -->\n\n```bash\nls\n```\n"
    assert db.python_blocks(page, "p.md") == [db.Block("p.md", 2, "python", "x = 1", "<!-- test: cuda -->")]
    assert db.misplaced_markers(page, "p.md") == [
        "p.md:6: test marker '<!-- test: cuda -->' is not on the line right before a ```python fence"
    ]


def test_a_block_is_checked_verbatim_against_its_file(tmp_path: Path) -> None:
    _write(tmp_path, "examples/x.py", "import os\n\n\ndef main():\n    return os.sep\n")
    inside = db.Block("README.md", 3, "python", "\ndef main():\n    return os.sep\n\n")
    assert db.verbatim_failure(inside, "examples/x.py", root=tmp_path) is None
    changed = db.Block("README.md", 3, "python", "def main():\n    return os.linesep")
    assert "not verbatim in examples/x.py" in str(db.verbatim_failure(changed, "examples/x.py", root=tmp_path))
    assert "names no file" in str(db.verbatim_failure(inside, "examples/y.py", root=tmp_path))


def test_a_failing_block_fails_with_its_page_line_and_stderr(tmp_path: Path) -> None:
    assert db.run_block(db.Block("README.md", 10, "python", "print('fine')"), db.Markers(), tmp_path) is None
    failing = db.Block("README.md", 10, "python", "import sys\nprint('said', file=sys.stderr)\nraise ValueError(7)")
    failure = str(db.run_block(failing, db.Markers(), tmp_path))
    assert failure.startswith("README.md:10: the block exited with status 1"), failure
    assert "said" in failure and "line 13" in failure and "ValueError: 7" in failure
    slow = db.Block("README.md", 20, "python", "import time\ntime.sleep(30)")
    assert "ran past its 1 s limit" in str(db.run_block(slow, db.Markers(), tmp_path, timeout_s=1))


def test_a_training_block_finds_its_model_loader_and_loss(tmp_path: Path) -> None:
    block = db.Block(
        "README.md",
        5,
        "python",
        "import torch\n\nfor x, y in loader:\n    loss = diffusion_loss(model, x, y)\n    loss.backward()\n"
        "assert loss.ndim == 0 and len(loader) == 3 and x.shape == (4, 4, 8, 8)\n"
        "assert all(p.grad is not None for p in model.parameters() if p.requires_grad)\n",
    )
    assert db.run_block(block, db.Markers(context="training"), tmp_path) is None


@pytest.mark.multirank
def test_a_block_on_two_ranks_runs_under_torchrun(tmp_path: Path) -> None:
    block = db.Block(
        "docs/api.md",
        3,
        "python",
        "import os\nimport torch\nimport torch.distributed as dist\nfrom torch.distributed.device_mesh import "
        "init_device_mesh\n\ndist.init_process_group('gloo')\nmesh = init_device_mesh('cpu', (2,))\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2 and os.environ['WORLD_SIZE'] == '2'\n",
    )
    assert db.run_block(block, db.Markers(ranks=2), tmp_path) is None
    failing = db.Block("docs/api.md", 3, "python", "import os\n\nassert os.environ['RANK'] == '0', 'not rank 0'\n")
    failure = str(db.run_block(failing, db.Markers(ranks=2), tmp_path))
    assert "line 6" in failure and "AssertionError: not rank 0" in failure, failure  # the rank's, not torchrun's
