"""The suite's tiers, chosen by markers set on whole modules (``pytestmark``; registered in pyproject.toml):

- ``vllm``: the module starts vLLM instances (the vLLM tier);
- ``pipes``: pipe, lookup buffer and data-path tests, which run real peer processes and engines and import no vLLM
  (the quick tier runs them on several xdist workers);
- neither: a unit test (the quick tier runs these in one process: each xdist worker would import vLLM).

So a new test module with no marker lands in the quick tier. scripts/test.sh selects the tiers with ``-m``. Because a
tier marker marks a whole module, a run whose ``-m`` names only tier markers can tell from a module's source, without
importing it, whether it selects any of its tests: the vLLM tier's run and each pipe-test worker skip the unit test
modules, which import vLLM (seconds of CPU each), as the lists of files they had before did.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
from pathlib import Path

import pytest

TIERS = ("vllm", "pipes")
_WORDS = {"and", "or", "not", "(", ")", *TIERS}


@functools.cache
def declared(path: Path) -> frozenset[str]:
    """The tier markers in the top-level ``pytestmark`` of the module at ``path`` (``pytest.mark.<name>``, alone or
    in a list)."""
    names: set[str] = set()
    for node in ast.parse(path.read_bytes(), str(path)).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            continue
        for sub in ast.walk(node.value):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                names.add(sub.attr)
    return frozenset(names.intersection(TIERS))


def _tiers_only(markexpr: str) -> bool:
    """Whether ``-m markexpr`` names tier markers only (then a module's tier markers decide whether it selects any
    of its tests)."""
    words = re.findall(r"\w+|\S", markexpr)
    return bool(words) and set(words) <= _WORDS


def unselected(path: Path, config: pytest.Config) -> bool:
    """Whether the test module at ``path`` has no test that this run's ``-m`` selects, known without importing it
    (``pytest_ignore_collect``). False where unknown: not a test module, or ``-m`` naming other markers."""
    markexpr = config.option.markexpr
    if not markexpr or not _tiers_only(markexpr) or path.suffix != ".py" or not path.is_file():
        return False
    if not any(fnmatch.fnmatch(path.name, pattern) for pattern in config.getini("python_files")):
        return False
    try:
        marks = declared(path)
        # only tier names, and/or/not and parentheses (checked above): Python reads them as pytest does
        return not eval(markexpr, {"__builtins__": {}}, {name: name in marks for name in TIERS})
    except SyntaxError:
        return False  # a module or a -m that does not parse: left to pytest, which reports it


def check(items: list[pytest.Item]) -> None:
    """Every collected test carries exactly the tier markers its module's ``pytestmark`` sets, and at most one: a
    tier marker on a class or a function, or a ``pytestmark`` this module cannot read, would put tests in a tier
    whose run never imports them."""
    wrong = []
    for item in items:
        path = getattr(item, "path", None)
        if path is None or path.suffix != ".py":
            continue
        on_item = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if on_item != declared(path) or len(on_item) > 1:
            wrong.append(f"{item.nodeid}: {sorted(on_item)}, its module's pytestmark {sorted(declared(path))}")
    if wrong:
        raise pytest.UsageError("tier markers (tests/tiers.py) go on whole modules, one at most, as "
                                "`pytestmark = pytest.mark.<tier>`:\n  " + "\n  ".join(wrong[:10]))
