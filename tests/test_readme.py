"""The README's two set-up commands exist, and CI runs exactly the test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_exactly_two_setup_commands():
    commands = _setup_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands)
    assert "pl-lowprec fit --config configs/quickstart.yaml" in commands[0]


def test_ci_runs_the_readme_test_command():
    ci_lines = ROOT.joinpath(".ci/run").read_text().splitlines()
    assert _setup_commands()[1] in ci_lines


def test_docs_name_no_path_of_a_build_machine():
    """A reader's machine has no /work/main or /tmp/prototypes: the docs name files in the repository instead."""
    pattern = re.compile(r"(?<![\w.])/(?:work|tmp|root|home)/\S*")
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.joinpath("docs").rglob("*.md")]
    pages += [*ROOT.joinpath("configs").glob("*.yaml")]
    found = {str(p.relative_to(ROOT)): pattern.findall(p.read_text()) for p in pages}
    assert {page: paths for page, paths in found.items() if paths} == {}
