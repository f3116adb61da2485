"""The package layers: each imports only the layers below it, so no import runs back up.

    modeling_carryover   the model and its decoding; also the remote code of every checkpoint (relative imports only)
    carryover_common     CLI parsing, target loading, benchmark prompts
    trainer              data, features, objectives, the Trainer
    evaluation, hub      measuring drafters; converting and publishing them (neither imports the other)
    serving              the vLLM plugin (exports through hub)
"""

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "modeling_carryover": set(),
    "carryover_common": {"modeling_carryover"},
    "trainer": {"modeling_carryover", "carryover_common"},
    "evaluation": {"modeling_carryover", "carryover_common", "trainer"},
    "hub": {"modeling_carryover", "carryover_common", "trainer"},
    "serving": {"modeling_carryover", "carryover_common", "trainer", "hub"},
}


def project_imports(path: Path) -> set[str]:
    """The project packages a module imports by absolute import (anywhere in the file, lazy imports included)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    return imported & set(ALLOWED)


@pytest.mark.parametrize("package", list(ALLOWED))
def test_no_import_runs_back_up_a_layer(package):
    offending = {}
    for path in sorted((REPO_ROOT / package).glob("*.py")):
        wrong = project_imports(path) - ALLOWED[package] - {package}
        if wrong:
            offending[path.name] = sorted(wrong)
    assert offending == {}, f"{package}/ imports layers above it or beside it: {offending}"


def test_the_checkpoint_code_imports_nothing_of_the_project_by_absolute_import():
    """modeling_carryover/ travels with every checkpoint: it loads where this project is not installed."""
    for path in sorted((REPO_ROOT / "modeling_carryover").glob("*.py")):
        assert project_imports(path) == set(), path.name


def test_scripts_need_no_sys_path_hacks():
    """The package is installed (editable) as the README says: no script puts the repository on sys.path itself."""
    folders = [*ALLOWED, "docs", "tests", "tests/scripts", *(p.relative_to(REPO_ROOT) for p in REPO_ROOT.glob("experiments/*"))]
    scripts = [path for folder in folders for path in (REPO_ROOT / folder).glob("*.py") if path != Path(__file__)]
    hacks = [str(path.relative_to(REPO_ROOT)) for path in scripts if "sys.path.insert(" in path.read_text(encoding="utf-8")]
    assert hacks == []
