"""The README and docs/ cannot rot: their Python runs, their links resolve, their figures name
the benchmark that produced them.

Every ```python block of README.md and docs/*.md is either executed here (as a script of its
own, in a temporary directory, on the emulator at preset O0: `$MNCORE_PRESET` and the device
layer's default preset are O0, so each runs in seconds), or is preceded by a line
``<!-- not-run: reason -->`` whose reason says why and names the test that covers it instead.
"""

from __future__ import annotations

import re
import runpy
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\s*$")
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
BENCHMARK = re.compile(r"benchmarks/(?P<script>\w+\.py)")
COMMAND = re.compile(r"python benchmarks/(?P<script>\w+\.py)(?P<args>[^`\n]*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason, where the block is marked not-run

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, start = match["indent"], i
        end = next(
            j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"
        )  # an unclosed fence raises StopIteration: a broken page
        code = "\n".join(line.removeprefix(indent) for line in lines[start + 1 : end])
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(previous)
        blocks.append(
            Block(page, start + 1, match["lang"], code, marker["reason"] if marker else None)
        )
        i = end + 1
    return blocks


PYTHON_BLOCKS = [b for page in PAGES for b in code_blocks(page) if b.lang == "python"]
RUNNABLE = [b for b in PYTHON_BLOCKS if b.not_run is None]
NOT_RUNNABLE = [b for b in PYTHON_BLOCKS if b.not_run is not None]


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    setup, tests = (
        "bash scripts/setup.sh && .venv/bin/python examples/mnist.py",
        (".venv/bin/python -m pytest -q"),
    )
    assert setup in readme and tests in readme
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ("bash scripts/setup.sh", ".venv/bin/python examples/mnist.py", tests):
        assert command in ci, command


def test_every_page_is_found_from_the_readme() -> None:
    linked = {
        (ROOT / m["target"].split("#")[0]).resolve()
        for m in LINK.finditer((ROOT / "README.md").read_text())
    }
    assert {p.resolve() for p in PAGES[1:]} <= linked


def test_the_pages_hold_python_to_run() -> None:
    assert len(RUNNABLE) >= 4 and len(PYTHON_BLOCKS) == len(RUNNABLE) + len(NOT_RUNNABLE)


@pytest.mark.parametrize("block", NOT_RUNNABLE, ids=lambda b: b.name)
def test_a_block_not_run_says_why_and_parses(block: Block) -> None:
    assert len(block.not_run) >= 20, f"{block.name}: give the reason a block is not run"
    for test_file in re.findall(r"tests/[\w/]+\.py", block.not_run):
        assert (ROOT / test_file).is_file(), f"{block.name} names {test_file}"
    # A fragment still has to be Python: lines from a method body parse once dedented.
    compile(block.code, block.name, "exec")


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_a_python_block_runs(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import mncore_device.presets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MNCORE_DEVICE", "pfvm:cpu")
    monkeypatch.setenv("MNCORE_PRESET", "O0")
    monkeypatch.setattr(mncore_device.presets, "DEFAULT_PRESET", "O0")
    script = tmp_path / f"{block.page.stem}_{block.line}.py"
    script.write_text(block.code + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            # This project's warnings fail the block: the docs show code that runs clean.
            warnings.filterwarnings("error", module=r"(mncore_lightning|mncore_device)(\..*)?$")
            warnings.filterwarnings("error", module=re.escape(script.stem) + "$")
            runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    for match in LINK.finditer(page.read_text()):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue  # web addresses are not checked here
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to {target}"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.name}: no heading for {target}"


def _flags(script: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_benchmark_commands_exist(page: Path) -> None:
    """Each benchmark named exists, and each quoted command uses only flags it defines."""
    text = page.read_text()
    for match in BENCHMARK.finditer(text):
        assert (ROOT / "benchmarks" / match["script"]).is_file(), match[0]
    for match in COMMAND.finditer(text):
        flags = set(re.findall(r"(?<!\S)(--[\w-]+)", match["args"]))
        unknown = flags - _flags(ROOT / "benchmarks" / match["script"])
        assert not unknown, f"{page.name}: {match[0]} uses {sorted(unknown)}"


def test_every_measurement_names_its_benchmark_and_date() -> None:
    """In the performance page, every section with a table of figures names the benchmark that
    produced them and the date of the measurement."""
    text = (ROOT / "docs" / "performance.md").read_text()
    sections = re.split(r"^#+ .*$", text, flags=re.MULTILINE)
    with_tables = [s for s in sections if re.search(r"^\|.*\d.*\|$", s, re.MULTILINE)]
    assert len(with_tables) >= 6
    for section in with_tables:
        first_row = re.search(r"^\|.*$", section, re.MULTILINE)[0]
        assert BENCHMARK.search(section), f"no benchmark named for the table {first_row}"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), f"no date for the table {first_row}"
