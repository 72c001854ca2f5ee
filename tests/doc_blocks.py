"""Reading the docs as the doc test does (``tests/unit/test_docs.py``): fenced code blocks and their test markers,
links and heading anchors, the ``dimuon`` commands shown; running a python block in a fresh process.

Everything here works on strings and paths, so the test can check each check on made-up pages. A marker comment
on the line right before a python fence, ``<!-- test: MARKER ... -->``, says how the block runs:
``context=training`` (``model``, ``loader`` and ``diffusion_loss`` predefined), ``ranks=N`` (N processes under
torchrun), ``file=PATH`` (the block's text is in PATH, which its own test runs), ``skip=REASON`` and ``cuda``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
# Pages whose ```python blocks are run (one test case per block); add a page here to have its blocks run.
PYTHON_PAGES: tuple[str, ...] = ("README.md", "docs/api.md")
# Pages whose links and commands are checked, besides every docs/**/*.md (a page not present is left out).
TOP_PAGES: tuple[str, ...] = ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")
PYTHON_LANGS = frozenset({"python", "py", "python3"})
SHELL_LANGS = frozenset({"bash", "sh", "shell", "zsh", "console", "shell-session"})
PROMPT_LANGS = frozenset({"console", "shell-session"})  # only the lines after a "$ " prompt are commands
BLOCK_TIMEOUT_S = 60
ALLOWED_MARKERS = "context=training, ranks=N (N >= 2), file=PATH, skip=REASON, cuda"
MARKER_LINE = re.compile(r"^\s*<!--\s*test\b")
MARKER = re.compile(r"^\s*<!--\s*test:(?P<body>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>.*?)\s*$")

# The names a ``context=training`` block finds defined: a tiny DiT, a few (images, labels) batches for it and the
# rectified-flow loss. Written to a module beside the block and imported on the block's first padding line.
TRAINING_CONTEXT = '''"""What a doc block marked context=training finds defined: model, loader, diffusion_loss."""

import torch

from dimuon.dit import build_dit, flow_loss

torch.manual_seed(0)
model = build_dit("DiT-T/2", input_size=8, in_channels=4, num_classes=10)
loader = [(torch.randn(4, 4, 8, 8), torch.randint(0, 10, (4,))) for _ in range(3)]


def diffusion_loss(model, x, y):
    """dimuon's rectified-flow loss of ``model`` on images ``x`` with class labels ``y``: a scalar tensor."""
    return flow_loss(model, x, y)
'''
CONTEXT_MODULE = "_doc_training_context"
# A rank of a multi-process block leaves without the interpreter's teardown: torch 2.13 with gloo aborts at exit
# once a DeviceMesh exists, which would fail a block that did its work.
RANKS_EPILOGUE = "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)\n"


# ------------------------------------------------------------------------------------------------ pages


def doc_pages(root: Path = REPO) -> list[str]:
    """The pages whose links and commands are checked: README.md, CHANGELOG.md, CONTRIBUTING.md and every
    docs/**/*.md that exist, as paths relative to ``root``."""
    found = [page for page in TOP_PAGES if (root / page).is_file()]
    found += sorted(p.relative_to(root).as_posix() for p in (root / "docs").rglob("*.md"))
    return found


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, the page line of its opening fence, its language and text, and the test
    marker comment on the line right before it (the comment's line, or None)."""

    page: str
    line: int
    lang: str
    text: str
    marker: str | None = None

    @property
    def id(self) -> str:
        """``page:line`` of the opening fence, the block's test id."""
        return f"{self.page}:{self.line}"


def _fences(lines: Sequence[str]) -> Iterator[tuple[int, int, str, list[str]]]:
    """``(opening index, closing index, info string, content lines)`` of every fenced block (an unclosed one
    runs to the end of the page)."""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or (m["fence"][0] == "`" and "`" in m["info"]):  # a backtick fence's info holds none
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        body = [line[min(indent, len(line) - len(line.lstrip(" "))) :] for line in lines[i + 1 : j]]
        yield i, j, m["info"], body
        i = j + 1


def read_blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of a page with its language (the info string's first word, lower case)."""
    lines = text.splitlines()
    blocks = []
    for start, _, info, body in _fences(lines):
        before = lines[start - 1] if start > 0 else ""
        marker = before.strip() if MARKER_LINE.match(before) else None
        lang = info.split()[0].lower() if info.split() else ""
        blocks.append(Block(page, start + 1, lang, "\n".join(body), marker))
    return blocks


def python_blocks(text: str, page: str) -> list[Block]:
    """The page's ```python blocks, the ones the doc test runs."""
    return [b for b in read_blocks(text, page) if b.lang in PYTHON_LANGS]


def masked_prose(text: str) -> str:
    """The page with its fenced blocks and HTML comments blanked out (line breaks kept, so positions still give
    page lines): what is left is the prose, where links and code spans are read."""
    lines = text.splitlines()
    for start, end, _, _ in _fences(lines):
        for k in range(start, min(end + 1, len(lines))):
            lines[k] = ""
    prose = "\n".join(lines)
    return re.sub(r"<!--.*?-->", lambda m: re.sub(r"[^\n]", " ", m.group()), prose, flags=re.DOTALL)


CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)


def code_spans(prose: str) -> list[tuple[int, str]]:
    """``(page line, content)`` of every inline code span of ``prose`` (see :func:`masked_prose`)."""
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())) for m in CODE_SPAN.finditer(prose)]


def without_code_spans(prose: str) -> str:
    """``prose`` with every inline code span blanked (line breaks kept): a link in one is no link."""
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), prose)


# ------------------------------------------------------------------------------------------------ markers


class MarkerError(ValueError):
    """A test marker the runner does not know, or one placed where it has no effect."""


@dataclass(frozen=True)
class Markers:
    """How a python block is run: with the training context, on ``ranks`` processes, checked against a file,
    skipped with a reason, or only where CUDA is available."""

    context: str | None = None
    ranks: int = 1
    file: str | None = None
    skip: str | None = None
    cuda: bool = False


def parse_markers(marker: str | None, where: str) -> Markers:
    """The markers of a ``<!-- test: ... -->`` comment (None: no marker); MarkerError naming ``where`` (page:line)
    and the allowed markers for anything else. ``skip=`` takes the rest of the comment as its reason."""
    if marker is None:
        return Markers()
    m = MARKER.match(marker)
    if m is None:
        raise MarkerError(
            f"{where}: malformed test marker {marker!r}; write <!-- test: MARKER ... -->, "
            f"MARKER one of {ALLOWED_MARKERS}"
        )
    found: dict[str, object] = {}
    body = m["body"].strip()
    if not body:
        raise MarkerError(f"{where}: empty test marker {marker!r}; allowed: {ALLOWED_MARKERS}")
    while body:
        token, _, rest = body.partition(" ")
        key, eq, value = token.partition("=")
        if key == "skip" and eq:
            value, rest = f"{value} {rest}".strip(), ""
        if key in found:
            raise MarkerError(f"{where}: test marker {key} given twice in {marker!r}")
        if key == "context" and value == "training":
            found["context"] = value
        elif key == "ranks" and value.isdigit() and int(value) >= 2:
            found["ranks"] = int(value)
        elif key in ("file", "skip") and value:
            found[key] = value
        elif key == "cuda" and not eq:
            found["cuda"] = True
        else:
            raise MarkerError(f"{where}: unknown test marker {token!r} in {marker!r}; allowed: {ALLOWED_MARKERS}")
        body = rest.strip()
    return Markers(**found)  # type: ignore[arg-type]


def misplaced_markers(text: str, page: str) -> list[str]:
    """Test markers that change nothing: not on the line right before a ```python fence (``page:line: why``)."""
    lines = text.splitlines()
    on_python = {b.line - 1 for b in read_blocks(text, page) if b.lang in PYTHON_LANGS and b.marker}
    inside = set()
    for start, end, _, _ in _fences(lines):
        inside.update(range(start + 1, end))
    return [
        f"{page}:{k + 1}: test marker {line.strip()!r} is not on the line right before a ```python fence"
        for k, line in enumerate(lines)
        if MARKER_LINE.match(line) and k not in inside and (k + 1) not in on_python
    ]


def verbatim_failure(block: Block, path: str, root: Path = REPO) -> str | None:
    """Why ``block``'s text (without its leading and trailing blank lines) is not in ``root/path``; None if it is."""
    target = root / path
    if not target.is_file():
        return f"{block.id}: file={path} names no file"
    text = block.text.strip("\n")
    if text in target.read_text(encoding="utf-8"):
        return None
    return f"{block.id}: the block is not verbatim in {path} (its text must appear there exactly, indentation included)"


# ------------------------------------------------------------------------------------------------ running a block


def block_program(block: Block, markers: Markers) -> str:
    """The script that runs ``block``: blank lines up to the block's first page line, so a traceback's line
    numbers are the page's; the training context imported on the first of them; the ranks' epilogue after it."""
    head = [""] * block.line
    if markers.context == "training":
        head[0] = f"from {CONTEXT_MODULE} import diffusion_loss, loader, model  # noqa: F401"
    program = "\n".join(head) + "\n" + block.text + "\n"
    return program + (RANKS_EPILOGUE if markers.ranks > 1 else "")


def block_env() -> dict[str, str]:
    """The environment of a block's process: this checkout's ``src`` first on the path, one thread per process
    unless set, and no rank variables inherited from a launcher around the test."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_block(block: Block, markers: Markers, workdir: Path, timeout_s: float = BLOCK_TIMEOUT_S) -> str | None:
    """Run ``block`` in a fresh process (``markers.ranks`` of them under torchrun on a free loopback port) with
    ``workdir`` as its directory; None when it exits 0, else why, with the end of its stderr."""
    script = workdir / f"doc_block_{re.sub(r'[^A-Za-z0-9]', '_', block.page)}_{block.line}.py"
    script.write_text(block_program(block, markers), encoding="utf-8")
    if markers.context == "training":
        (workdir / f"{CONTEXT_MODULE}.py").write_text(TRAINING_CONTEXT, encoding="utf-8")
    command = [sys.executable, str(script)]
    if markers.ranks > 1:
        from dimuon.bench.launch import free_port

        command[1:1] = ["-m", "torch.distributed.run", f"--nproc-per-node={markers.ranks}"]
        command[4:4] = ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    proc = subprocess.Popen(
        command,
        cwd=workdir,
        env=block_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        what = None if proc.returncode == 0 else f"exited with status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        what = f"ran past its {timeout_s:g} s limit"
    if what is None:
        return None
    lines = (err or out).splitlines()
    launcher = [k for k, line in enumerate(lines) if "elastic/multiprocessing/api.py" in line and "failed" in line]
    tail = "\n".join(lines[: launcher[0] if launcher else len(lines)][-40:])  # the ranks' output, not torchrun's
    return f"{block.id}: the block {what} (traceback line numbers are the page's)\n--- end of its output ---\n{tail}"


# ------------------------------------------------------------------------------------------------ links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lower case, punctuation other than ``-`` and ``_``
    dropped, each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")


def headings(text: str) -> list[str]:
    """The text of every heading of a page, in order (ATX ``#`` headings and ``===``/``---`` underlined ones)."""
    lines = masked_prose(text).splitlines()
    found = []
    for k, line in enumerate(lines):
        m = ATX.match(line)
        if m:
            found.append(m.group(2) or "")
        elif (
            k > 0
            and SETEXT.match(line)
            and lines[k - 1].strip()
            and not ATX.match(lines[k - 1])
            and not SETEXT.match(lines[k - 1])
            and not lines[k - 1].lstrip().startswith(("|", ">", "- ", "* ", "+ "))
        ):
            found.append(lines[k - 1].strip())
    return found


def anchors(text: str) -> set[str]:
    """The anchors a link into the page may name: heading slugs (a repeated one numbered ``-1``, ``-2``, ...) and
    HTML ``id``/``name`` attributes."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found.update(re.findall(r"""<[a-zA-Z][^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']""", masked_prose(text)))
    return found


INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(?P<target><[^>\n]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*(?P<target>\S+)", re.MULTILINE)
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["'](?P<target>[^"']+)["']""", re.IGNORECASE)
EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def links(text: str) -> list[tuple[int, str]]:
    """``(page line, target)`` of every link and image of a page's prose (``[t](x)``, ``![i](x)``, ``[r]: x``,
    ``<a href>``, ``<img src>``); links in code blocks and code spans are not links."""
    prose = without_code_spans(masked_prose(text))
    found = []
    for pattern in (INLINE_LINK, REFERENCE, HTML_LINK):
        for m in pattern.finditer(prose):
            found.append((prose.count("\n", 0, m.start()) + 1, m["target"].strip("<>")))
    return sorted(found)


# ------------------------------------------------------------------------------------------------ tables

TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(?:\|\s*:?-{3,}:?\s*)*\|?\s*$")


def table_cells(line: str) -> list[str]:
    """The cells of a Markdown table row: split on ``|`` outside code spans and escapes, outer pipes dropped."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    cells, cell, in_code, i = [], "", False, 0
    while i < len(inner):
        ch = inner[i]
        if ch == "\\" and i + 1 < len(inner):
            cell += inner[i : i + 2]
            i += 2
            continue
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(cell)
            cell = ""
        else:
            cell += ch
        i += 1
    return [*cells, cell]


def table_failures(page: str, root: Path = REPO) -> list[str]:
    """``page:line: ...`` for every Markdown table whose rule or rows have another number of cells than its header
    (GitHub renders no table under a short rule, and drops or pads cells of a row that differs)."""
    lines = masked_prose((root / page).read_text(encoding="utf-8")).splitlines()
    failures = []
    for i in range(1, len(lines)):
        if not (TABLE_RULE.match(lines[i]) and "|" in lines[i] and lines[i - 1].lstrip().startswith("|")):
            continue
        width = len(table_cells(lines[i - 1]))
        j = i
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            if len(table_cells(lines[j])) != width:
                what = "rule" if j == i else "row"
                failures.append(
                    f"{page}:{j + 1}: the table's {what} has {len(table_cells(lines[j]))} cells, its header {width}"
                )
            j += 1
    return failures


def link_failures(page: str, root: Path = REPO) -> list[str]:
    """Every relative link of ``page`` (relative to ``root``) that names no file, or an anchor no heading of its
    Markdown target has (``page:line: target: why``). External links (a scheme, ``//``) are not checked."""
    path = root / page
    text = path.read_text(encoding="utf-8")
    failures = []
    cache: dict[Path, set[str]] = {}
    for line, target in links(text):
        where = f"{page}:{line}: {target}"
        if not target:
            failures.append(f"{where}: empty link")
            continue
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part.split("?", 1)[0])
        if not file_part:
            dest = path
        elif file_part.startswith("/"):
            dest = root / file_part.lstrip("/")
        else:
            dest = path.parent / file_part
        dest = Path(os.path.normpath(dest))
        if not dest.is_relative_to(root):
            failures.append(f"{where}: points outside the repository")
            continue
        if not dest.exists():
            failures.append(f"{where}: no such file {dest.relative_to(root).as_posix()}")
            continue
        if anchor and dest.is_file() and dest.suffix.lower() in (".md", ".markdown"):
            if dest not in cache:
                cache[dest] = anchors(dest.read_text(encoding="utf-8"))
            if unquote(anchor).lower() not in cache[dest]:
                failures.append(f"{where}: no heading of {dest.relative_to(root).as_posix()} has the anchor #{anchor}")
    return failures


# ------------------------------------------------------------------------------------------------ commands


@dataclass(frozen=True)
class Command:
    """A ``dimuon`` command shown on a page: where, as written, the arguments ``dimuon.cli.parse`` gets (or, in
    ``error``, why there are none), the number of processes torchrun starts for it (0: not under torchrun), and
    whether it is a command's name alone in prose (``dimuon sample``), which only has to name a command."""

    page: str
    line: int
    text: str
    argv: tuple[str, ...] = ()
    error: str | None = None
    torchrun: int = 0
    name_only: bool = False


def logical_lines(text: str, prompt_only: bool = False) -> list[tuple[int, str]]:
    """``(line offset, line)`` of a shell block's logical lines: ``\\`` continuations joined, a leading ``$ ``
    prompt dropped (``prompt_only``: a console block, where only prompted lines are commands)."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for k, raw in enumerate(text.splitlines()):
        if pending is None:
            stripped = raw.lstrip()
            prompted = stripped.startswith("$ ") or stripped == "$"
            if prompt_only and not prompted:
                continue
            line, start = (stripped[2:] if prompted else raw), k
        else:
            start, line = pending[0], pending[1] + " " + raw.strip()
        if line.rstrip().endswith("\\"):
            pending = (start, line.rstrip()[:-1].rstrip())
            continue
        pending = None
        out.append((start, line.strip()))
    if pending is not None:
        out.append(pending)
    return out


def statements(line: str) -> list[str]:
    """The simple commands of a shell line: split on ``&&``, ``||``, ``;``, ``|`` and ``&`` outside quotes, a
    ``#`` comment dropped."""
    parts, current, quote, k = [], [], "", 0
    while k < len(line):
        c = line[k]
        if quote:
            if c == "\\" and quote == '"' and k + 1 < len(line):
                current.append(line[k : k + 2])
                k += 2
                continue
            quote = "" if c == quote else quote
            current.append(c)
        elif c == "\\" and k + 1 < len(line):
            current.append(line[k : k + 2])
            k += 2
            continue
        elif c in "'\"":
            quote = c
            current.append(c)
        elif c == "#" and (k == 0 or line[k - 1].isspace()):
            break
        elif (
            c in ";|&"
            and not (c == "&" and k > 0 and line[k - 1] in "<>")
            and not (c == "&" and line[k + 1 : k + 2] == ">")
        ):
            parts.append("".join(current))
            current = []
            if line[k + 1 : k + 2] == c:
                k += 1
        else:
            current.append(c)
        k += 1
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
REDIRECT = re.compile(r"^(?:\d*|&)(?:>>?|<)(?:&?\d+)?$|^(?:\d*|&)(?:>>?|<)\S+$")
PLACEHOLDER = re.compile(r"^<[^<>\s]+>$")
# A value standing for one the reader fills in: RUN, DIR, N, $NODES, ${OUT}.
CAPITALS = re.compile(r"^(?:[A-Z][A-Z0-9_]*|\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\})$")
WRAPPERS = frozenset({"env", "time", "nohup", "exec", "command"})


def command_modules() -> dict[str, tuple[str, ...]]:
    """``python -m MODULE`` forms of the commands: the module -> the ``dimuon`` arguments that name it."""
    from dimuon import cli

    modules: dict[str, tuple[str, ...]] = {"dimuon.cli": (), "dimuon.eval": ("eval",)}
    modules.update({module: (name,) for name, module in cli.COMMANDS.items()})
    modules.update({module: ("bench", name) for name, module in cli.BENCHMARKS.items()})
    return modules


def _torchrun_ranks(words: Sequence[str]) -> int:
    """Processes per node of a torchrun command line (``--nproc-per-node N``, ``--nproc_per_node=N``; 1 when not
    given or not a number)."""
    for k, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            value = value if eq else (words[k + 1] if k + 1 < len(words) else "")
            return int(value) if value.isdigit() else 1
    return 1


def dimuon_argv(tokens: Sequence[str]) -> tuple[tuple[str, ...] | None, str | None, int]:
    """``(arguments of dimuon.cli.parse, None, torchrun's processes or 0)`` for a command that runs dimuon
    (``dimuon ...``, ``python -m dimuon.cli ...``, ``python -m dimuon.bench.X ...``, ``torchrun ... -m dimuon.cli
    ...``); ``(None, why, 0)`` for a dimuon module that is no command; ``(None, None, 0)`` for any other command.
    Environment assignments, redirections and ``env``/``time``-like wrappers are dropped first."""
    words: list[str] = []
    skip_next = False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif REDIRECT.match(token) and not PLACEHOLDER.match(token):
            skip_next = re.fullmatch(r"(?:\d*|&)(?:>>?|<)", token) is not None
        else:
            words.append(token)
    while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] in WRAPPERS):
        words.pop(0)
    if not words:
        return None, None, 0
    if words[0] == "dimuon":
        return tuple(words[1:]), None, 0
    launched = words[0] == "torchrun" or "torch.distributed.run" in words
    ranks = _torchrun_ranks(words) if launched else 0
    for k, word in enumerate(words):
        if word.startswith("-m") and len(word) > 2:
            module, rest = word[2:], words[k + 1 :]
        elif word == "-m" and k + 1 < len(words):
            module, rest = words[k + 1], words[k + 2 :]
        elif word in ("--no-python", "--no_python") and "dimuon" in words[k:]:
            return tuple(words[words.index("dimuon", k) + 1 :]), None, ranks
        else:
            continue
        if module == "dimuon" or module.startswith("dimuon."):
            prefix = command_modules().get(module)
            if prefix is None:
                return None, f"python -m {module} is not a dimuon command (dimuon --help lists them)", 0
            return (*prefix, *rest), None, ranks
    return None, None, 0


def _commands_of(page: str, line: int, text: str, span: bool = False) -> list[Command]:
    """The dimuon commands of one shell line (or, ``span``, inline code span) at page line ``line``. A message a
    command prints (``dimuon train: error: ...``) is no command."""
    found = []
    for statement in statements(text):
        if "dimuon" not in statement:
            continue
        try:
            tokens = shlex.split(statement)
        except ValueError as exc:
            found.append(Command(page, line, statement, error=f"not a shell command ({exc})"))
            continue
        argv, error, ranks = dimuon_argv(tokens)
        if (argv is None and error is None) or (argv and argv[0].endswith(":")):
            continue
        holders = [t for t in (argv or ()) if PLACEHOLDER.match(t)]
        if holders:
            error = f"placeholder {holders[0]} (write placeholders in capitals, e.g. RUN or DIR)"
        name_only = span and bool(argv) and len(argv or ()) <= 2 and not any(a.startswith("-") for a in argv or ())
        found.append(Command(page, line, statement, argv or (), error, ranks, name_only))
    return found


def skipped_span(span: str) -> bool:
    """An inline span that mentions a command rather than showing one: a glob (``*``), an ellipsis or a
    ``<placeholder>``."""
    return any(mark in span for mark in ("*", "...", "\u2026", "<", ">"))


def page_commands(text: str, page: str) -> list[Command]:
    """Every dimuon command a page shows: the lines of its bash/sh/console blocks and the inline code spans that
    start with ``dimuon `` (spans with a glob, an ellipsis or a ``<placeholder>`` are left out)."""
    found = []
    for block in read_blocks(text, page):
        if block.lang in SHELL_LANGS:
            for offset, line in logical_lines(block.text, prompt_only=block.lang in PROMPT_LANGS):
                found += _commands_of(page, block.line + 1 + offset, line)
    for line, span in code_spans(masked_prose(text)):
        if span.startswith("dimuon ") and not skipped_span(span):
            found += _commands_of(page, line, span, span=True)
    return sorted(found, key=lambda c: c.line)


@contextlib.contextmanager
def as_if(torchrun: int = 0) -> Iterator[None]:
    """Inside, torch reports 8 CUDA devices (a command's flags are checked as on a GPU machine), and with
    ``torchrun`` processes, rank 0's environment of a torchrun launch is set."""
    import torch

    env = {}
    if torchrun:
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(torchrun), "LOCAL_WORLD_SIZE": str(torchrun)}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "doc"}
    with (
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 8),
        mock.patch.dict(os.environ, env),
    ):
        yield


def _condensed(text: str, limit: int = 400) -> str:
    """A parser's message on one line: box drawing and runs of spaces removed, cut at ``limit`` characters."""
    text = re.sub(r"[\u2500-\u257f]|-{3,}", " ", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_once(argv: Sequence[str], torchrun: int, name_only: bool) -> str | None:
    """One try of :func:`parse_failure`."""
    from dimuon import cli

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), as_if(torchrun):
            if name_only:
                cli.route(argv)
            else:
                cli.parse(list(argv), saved_defaults=False)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        return f"exit {exc.code}: {_condensed(err.getvalue() or out.getvalue())}"
    except Exception as exc:  # a parser that raises is itself wrong: report it with the command
        return f"raised {type(exc).__name__}: {_condensed(str(exc))}"
    return None


def parse_failure(argv: Sequence[str], torchrun: int = 0, name_only: bool = False) -> str | None:
    """Why ``dimuon.cli.parse`` refuses ``argv`` (its exit status and message), or None where it parses (help and
    version included). Run in this process, as on a machine with CUDA (under torchrun's environment where
    ``torchrun`` is the number of processes), without reading a ``--resume`` run. A value in capitals or a shell
    variable (RUN, N, $NODES) stands for one the reader fills in: tried as written, then as 1 (a number).
    ``name_only``: the arguments only have to name a command (``dimuon sample`` in prose)."""
    first = _parse_once(argv, torchrun, name_only)
    if first is None or not any(CAPITALS.match(a) for a in argv):
        return first
    filled = ["1" if CAPITALS.match(a) else a for a in argv]
    return None if _parse_once(filled, torchrun, name_only) is None else first


def command_failures(page: str, root: Path = REPO) -> list[str]:
    """Every dimuon command of ``page`` that does not parse (``page:line: `command`: why``)."""
    failures = []
    for command in page_commands((root / page).read_text(encoding="utf-8"), page):
        why = command.error or parse_failure(command.argv, command.torchrun, command.name_only)
        if why is not None:
            failures.append(f"{command.page}:{command.line}: `{command.text}`: {why}")
    return failures
