"""The README stays short and its example parses; every relative link in README, CONTRIBUTING and docs/ resolves."""

import re
from pathlib import Path

import pytest

from pl_lowprec.cli import build_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped except '-' and '_', spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _relative_links() -> list[tuple[Path, str]]:
    return [
        (page, target)
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if not target.startswith(("http://", "https://", "mailto:"))
    ]


def test_docs_have_relative_links_to_check():
    assert len(_relative_links()) > 20


@pytest.mark.parametrize(("page", "target"), _relative_links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_every_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in _anchors(resolved), f"{page.relative_to(ROOT)} links to #{anchor}, no such heading"


def test_readme_is_a_short_front_page():
    assert len(ROOT.joinpath("README.md").read_text().splitlines()) <= 150


def test_readme_yaml_example_parses_with_the_cli(tmp_path, capsys):
    readme = ROOT.joinpath("README.md").read_text()
    (example,) = re.findall(r"```yaml\n(.+?)```", readme, flags=re.S)
    config = tmp_path / "example.yaml"
    config.write_text(example)
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "LowPrecisionStrategy" in printed and "nf4-dq" in printed and "CausalLM" in printed
