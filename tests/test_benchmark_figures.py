"""Every table of docs/benchmarks.md names the command that prints it, the machine and the date.

The figures themselves depend on the machine, so they are not compared with a fresh run here; the line above
each table says where they came from, and ``python benchmarks/run_all.py --only SECTION`` reprints one.
"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"python benchmarks/run_all\.py --only ([a-z_]+)")
ANY_BENCHMARK = re.compile(r"python benchmarks/[a-z_]+\.py")
FIGURES = ROOT / "docs" / "benchmarks.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _sections() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks/run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib imports only: the sections are imported when they run
    return module.SECTIONS


def test_every_command_in_the_docs_names_a_section_and_every_section_is_cited():
    docs = "\n".join(path.read_text() for path in DOCS)
    assert set(COMMAND.findall(docs)) == set(_sections())
    for script in re.findall(r"benchmarks/[a-z_]+\.py", docs):
        assert (ROOT / script).is_file(), script


def test_every_measured_table_follows_the_command_that_prints_it():
    section = FIGURES.read_text()
    header = section.split("\n\n", 3)[2]
    assert re.search(r"\d{4}-\d{2}-\d{2}", header) and "avx512_bf16" in header, header  # the date, the decisive flag
    tables, command_seen, in_table = 0, False, False
    for line in section.splitlines():
        if line.startswith("|"):
            if not in_table:
                assert command_seen, f"no `python benchmarks/...` command before the table {line!r}"
                tables, command_seen = tables + 1, False
            in_table = True
        else:
            in_table = False
            command_seen = command_seen or bool(ANY_BENCHMARK.search(line))
    assert tables >= 4
