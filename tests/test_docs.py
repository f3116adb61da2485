"""The documentation stays true to the code: docs/cli.md is what docs/cli_reference.py generates from the scripts'
argument dataclasses, and every relative link of the project's Markdown resolves (docs/check_links.py)."""

import importlib.util
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_reference_is_current():
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "docs", "cli_reference.py"), "--check"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_markdown_links_resolve():
    spec = importlib.util.spec_from_file_location("check_links", os.path.join(REPO_ROOT, "docs", "check_links.py"))
    check_links = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_links)
    broken = check_links.broken_links()
    assert not broken, "broken links:\n" + "\n".join(broken)
