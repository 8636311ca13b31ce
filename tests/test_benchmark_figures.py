"""Every table of the README's "Measured figures" names the command that prints it, the machine and the date.

The figures themselves depend on the machine, so they are not compared with a fresh run here; the line above
each table says where they came from, and ``python benchmarks/run_all.py --only SECTION`` reprints one.
"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"python benchmarks/run_all\.py --only ([a-z_]+)")


def _sections() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks/run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib imports only: the sections are imported when they run
    return module.SECTIONS


def _measured_figures() -> str:
    return ROOT.joinpath("README.md").read_text().split("## Measured figures", 1)[1].split("\n## ", 1)[0]


def test_every_command_in_the_readme_names_a_section_and_every_section_is_cited():
    readme = ROOT.joinpath("README.md").read_text()
    assert set(COMMAND.findall(readme)) == set(_sections())
    for script in re.findall(r"benchmarks/[a-z_]+\.py", readme):
        assert (ROOT / script).is_file(), script


def test_every_measured_table_follows_the_command_that_prints_it():
    section = _measured_figures()
    header = section.split("\n\n", 2)[1]
    assert re.search(r"\d{4}-\d{2}-\d{2}", header) and "avx512_bf16" in header, header  # the date, the decisive flag
    tables, command_seen, in_table = 0, False, False
    for line in section.splitlines():
        if line.startswith("|"):
            if not in_table:
                assert command_seen, f"no `python benchmarks/run_all.py --only ...` before the table {line!r}"
                tables, command_seen = tables + 1, False
            in_table = True
        else:
            in_table = False
            command_seen = command_seen or bool(COMMAND.search(line))
    assert tables >= 4
