"""The package's import graph (no circle) and the strategy names that importing it registers with Lightning."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pl_lowprec"


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, function-level ones included (not under ``if TYPE_CHECKING:``)."""
    hidden = {id(n) for node in ast.walk(tree) if _type_checking_only(node) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in hidden]


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: its body, and the ``if``/``try`` blocks in it (not the
    bodies of functions or classes' methods, nor ``if TYPE_CHECKING:``)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.ClassDef) and not _type_checking_only(node):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path], statements=module_level_imports) -> set[str]:
    """The package's modules that importing ``name`` initialises, by its module-level import statements.

    ``import a.b.c`` initialises ``a.b`` (its ``__init__``) and ``a.b.c``; the packages that hold ``name`` itself
    are already being initialised, so they add no edge unless a name is taken from them (``from a import X``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    holders = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    targets: set[str] = set()
    for node in statements(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            dotted = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in dotted:
            parts = target.split(".")
            chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - holders | {target}
            targets |= {m for m in chain if m in modules and m != name}
    return targets


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def import_graph(statements=module_level_imports, package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported_modules(name, path, modules, statements) for name, path in modules.items()}


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert graph["pl_lowprec.cli.dispatch"] >= {"pl_lowprec.cli.export", "pl_lowprec.cli.estimate"}  # it reads edges
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_circle_hides_behind_a_function_level_import():
    """A circle that survives only because one of its imports sits in a function is still a circle of layers."""
    circle = find_circle(import_graph(all_imports))
    assert circle is None, "import circle (through function-level imports): " + " -> ".join(circle)


def test_no_module_takes_a_private_name_from_another():
    """A ``_name`` is its module's own: another module that needs it needs a public name (or the function moved
    where both can import it), else a change inside the one module breaks the other unseen. Private modules
    (``pl_lowprec._imports``) are the package's own helpers: their names are public within it."""
    modules = module_names()
    taken = []
    for name, path in modules.items():
        for node in all_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("pl_lowprec"):
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            taken += [f"{name} imports {node.module}.{alias}" for alias in private if node.module != name]
    assert not taken, "; ".join(taken)


def test_the_circle_finder_finds_one_through_a_package_init():
    # a.b imports c, c imports a.d: initialising a.d runs a/__init__, which imports a.b (partially initialised)
    graph = {"a": {"a.b"}, "a.b": {"c"}, "c": {"a", "a.d"}, "a.d": set()}
    assert find_circle(graph) == ["a", "a.b", "c", "a"]
    assert find_circle({"a": {"a.b"}, "a.b": {"c"}, "c": {"a.d"}, "a.d": set()}) is None


def _fresh(code: str) -> tuple[list[str], str]:
    """Lightning's strategy names added by ``code`` in a fresh interpreter, and what it wrote to stderr."""
    script = (
        "import json\nfrom lightning.pytorch.strategies import StrategyRegistry\nbefore = set(StrategyRegistry)\n"
        f"{code}\nprint(json.dumps(sorted(set(StrategyRegistry) - before)))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stdout + done.stderr


def _said(printed: str, label: str) -> list[str]:
    """The JSON list the fresh interpreter printed after ``label``."""
    return json.loads(next(line for line in printed.splitlines() if line.startswith(f"{label} "))[len(label) + 1 :])


def _names_now(label: str) -> str:
    return f"print({label!r}, json.dumps(sorted(set(StrategyRegistry) - before)))"


@pytest.fixture(scope="module")
def estimate_then_cli() -> tuple[list[str], str]:
    """One fresh interpreter (each imports torch and Lightning: seconds) for two facts: importing a part of the
    package first (``pl_lowprec.memory.estimate``) registers every name, then the CLI finds one named in a config."""
    code = f"""
import pl_lowprec.memory.estimate
{_names_now("ESTIMATE")}
from pl_lowprec.cli import build_cli
cli = build_cli(["--config", {str(ROOT / "configs/quickstart.yaml")!r}, "--trainer.strategy=lowprec",
                 "--trainer.logger=false"], run=False)
assert type(cli.trainer.strategy).__name__ == "LowPrecisionStrategy", cli.trainer.strategy
"""
    return _fresh(code)


NAMES = ["lowprec", "lowprec_ddp", "lowprec_ddp_spawn", "lowprec_fsdp"]


@pytest.fixture(scope="module")
def package_then_strategies() -> tuple[list[str], str]:
    """One fresh interpreter for the two tests below: ``import pl_lowprec`` first (the names, no strategies),
    each name built and a fit, then the classes taken from the package and ``pl_lowprec.strategies`` imported
    (the registry's own entries). A fresh interpreter imports torch and Lightning again: seconds each."""
    code = f"""
import sys
import pl_lowprec
assert "pl_lowprec.strategies" not in sys.modules, "import pl_lowprec imported the strategies"
{_names_now("PACKAGE")}
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
for name, devices, cls, start in [("lowprec", 1, "LowPrecisionStrategy", None),
                                  ("lowprec_ddp", 2, "LowPrecisionDDPStrategy", "popen"),
                                  ("lowprec_ddp_spawn", 2, "LowPrecisionDDPStrategy", "spawn"),
                                  ("lowprec_fsdp", 2, "LowPrecisionFSDPStrategy", None)]:
    strategy = Trainer(strategy=name, accelerator="cpu", devices=devices, logger=False).strategy
    assert type(strategy).__name__ == cls, (name, strategy)
    assert getattr(strategy, "_start_method", None) == start, (name, strategy._start_method)
Trainer(strategy="lowprec", accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False).fit(BoringModel())
from pl_lowprec import LowPrecisionStrategy
{_names_now("CLASS")}
import pl_lowprec.strategies
own = sorted(n for n, e in StrategyRegistry.items()
             if getattr(e["strategy"], "__module__", "").startswith("pl_lowprec.strategies."))
print("OWN", json.dumps(own))
"""
    return _fresh(code)


def test_import_pl_lowprec_registers_every_strategy_name_without_importing_the_strategies(
    package_then_strategies, estimate_then_cli
):
    """``import pl_lowprec`` is enough for ``Trainer(strategy="lowprec_ddp")``; the names map to factories, so the
    strategies (and what they import) load only when one is built. A plain ``Trainer`` then fits without
    Lightning 2.6's warning that torch deprecates ``LeafSpec`` (its own call, nothing to change): ``import
    pl_lowprec`` drops it, not only ``pl-lowprec``."""
    printed = package_then_strategies[1]
    assert _said(printed, "PACKAGE") == NAMES
    assert "max_steps=1` reached" in printed  # it did fit
    assert "LeafSpec" not in printed
    assert _said(estimate_then_cli[1], "ESTIMATE") == NAMES  # any part of the package, in a fresh interpreter


def test_importing_the_strategies_registers_their_names_and_only_the_factories_names(package_then_strategies):
    """Building by name hands over to the class's own entry; no class registers a name the factories miss."""
    registered, printed = package_then_strategies
    assert registered == NAMES
    from pl_lowprec.strategy_names import STRATEGY_NAMES

    assert _said(printed, "OWN") == sorted(STRATEGY_NAMES) == NAMES
    assert _said(printed, "CLASS") == NAMES  # the class taken from the package, after its names were built


def test_a_strategy_named_in_a_config_is_found_by_the_cli(estimate_then_cli):
    assert "lowprec" in estimate_then_cli[0]
