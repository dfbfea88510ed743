"""The docs agree with the code, and the README's commands run as printed: docs/configuration.md lists every key the
code accepts (and only those) with the code's defaults, docs/operations.md names every connector counter, every
fenced shell command of the README names files that exist and flags its programs accept, and every path and link in
the docs resolves. Quick: no server starts (the proxy's entry point runs with --help only)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kv_connector import param_keys
from kv_connector.config import ConnectorOptions
from kv_connector.stats import COUNTERS, GAUGES
from kv_lookup_buffer import StoreConfig
from kv_pipe import MooncakeTransferEngineConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
OPERATIONS = ROOT / "docs" / "operations.md"
DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# Paths the docs name that other parts of issue #48 create (the proxy's manual, the benchmarks' README, the
# connector's and the pipe's modules under their new names); once they are merged this set is empty.
PENDING: frozenset[str] = frozenset()
SETUP_MADE = (".venv/", ".cache/")  # what scripts/setup.sh makes: not in a fresh clone, there after either command
OPERATORS = {"|", "||", "&&", ";", "&"}
PATH_IN_TEXT = re.compile(
    r"(?<![\w/.:-])((?:kv_pipe|kv_lookup_buffer|kv_connector|kv_proxy|harness|tests|scripts|benchmarks|docs)"
    r"/[\w./-]*\w)")
LOOKS_LIKE_FILE = re.compile(r"^[\w.-]+(/[\w.-]+)*\.(py|sh|json|example|md|toml)$|^(scripts|docs|benchmarks|harness)/")


# ---------------------------------------------------------------- markdown
def section(path: Path, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    text = path.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{path.name} has no section '## {heading}'"
    return match.group(1)


def cells(line: str) -> list[str]:
    """A table row's cells; a ``|`` inside a code span does not split."""
    out, cell, code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return [*out, cell.strip()]


def table(text: str) -> dict[str, list[str]]:
    """The rows of the markdown table(s) in ``text`` by their first cell's first code span (its first word)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith("|") or re.match(r"^\|[-| ]+\|$", line):
            continue
        row = cells(line)
        key = re.match(r"`([^`]+)`", row[0])
        if key:
            rows[key.group(1).split()[0]] = row
    return rows


def leading_value(cell: str) -> tuple[bool, Any]:
    """(True, value) if the cell starts with a code span holding a JSON value (the default as written), else (False,
    None): prose such as "half the machine's RAM" or "none"."""
    match = re.match(r"`([^`]*)`", cell)
    if not match:
        return False, None
    try:
        return True, json.loads(match.group(1))
    except json.JSONDecodeError:
        return False, None


def same(documented: Any, actual: Any) -> bool:
    return documented == actual and isinstance(documented, bool) == isinstance(actual, bool)


def check_table_against_dataclass(cls: type, rows: dict[str, list[str]], where: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert sorted(rows) == sorted(fields), (
        f"{where}: missing from the docs {sorted(set(fields) - set(rows))}, not in the code {sorted(set(rows) - set(fields))}")
    for name, field in fields.items():
        fixed = field.default is not dataclasses.MISSING and field.default is not None
        written, value = leading_value(rows[name][1])
        if fixed:
            assert written and same(value, field.default), (
                f"{where}: {name}'s default is {field.default!r} in the code, the docs say {rows[name][1]!r}")
        else:  # computed (from the RAM) or none: the docs describe it, they must not claim a fixed value
            assert not written, f"{where}: {name} has no fixed default in the code, the docs say {rows[name][1]!r}"


# ---------------------------------------------------------------- configuration.md
def test_every_mooncake_json_key_is_documented_with_its_default() -> None:
    check_table_against_dataclass(MooncakeTransferEngineConfig, table(section(CONFIGURATION, "mooncake.json")),
                                  "docs/configuration.md, mooncake.json")


def test_every_pool_key_is_documented_with_its_default() -> None:
    check_table_against_dataclass(StoreConfig, table(section(CONFIGURATION, "mooncake.json: the KV pool")),
                                  "docs/configuration.md, mooncake.json: the KV pool")


def test_every_connector_option_is_documented_with_its_default() -> None:
    check_table_against_dataclass(ConnectorOptions, table(section(CONFIGURATION, "kv_connector_extra_config")),
                                  "docs/configuration.md, kv_connector_extra_config")


def test_every_kv_transfer_params_key_is_documented() -> None:
    keys = {value for name, value in vars(param_keys).items()
            if name.isupper() and isinstance(value, str) and not name.endswith("_LABEL") and name != "ENDPOINT_INFO"}
    text = section(CONFIGURATION, "kv_transfer_params (per request)")
    missing = sorted(k for k in keys if f'"{k}"' not in text and f"`{k}`" not in text)
    assert len(keys) >= 10 and not missing, f"docs/configuration.md, kv_transfer_params: {missing} not described"


@functools.cache
def usage_flags(*command: str) -> frozenset[str]:
    """The ``--flags`` an argparse program accepts, read off its ``--help`` usage (run as users run it)."""
    out = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    usage = out.stdout.split("\n\n", 1)[0]
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", usage)) - {"--help"}


def test_every_proxy_option_is_documented_with_its_default() -> None:
    import proxy_server

    rows = table(section(ROOT / "docs" / "proxy.md", "Options"))
    flags = usage_flags("proxy_server.py")
    assert sorted(rows) == sorted(flags), (
        f"missing from the docs {sorted(flags - set(rows))}, not accepted {sorted(set(rows) - flags)}")
    config = proxy_server.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    checked = 0
    for flag, row in rows.items():
        written, value = leading_value(row[1])
        attribute = flag[2:].replace("-", "_")
        if written and hasattr(config, attribute):
            actual = getattr(config, attribute)
            assert same(value, actual), f"{flag}: the docs say {row[1]}, the code {actual!r}"
            checked += 1
    assert checked >= 10, "the proxy's defaults were not compared"


# ---------------------------------------------------------------- operations.md
def test_every_connector_metric_is_documented_and_every_documented_one_exists() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    missing = [name for name in COUNTERS if f"vllm:mooncake_kv_{name}_total" not in text]
    assert not missing, f"docs/operations.md does not name {missing}"
    known = {f"{name}_total" for name in COUNTERS} | set(GAUGES) | {"endpoint_info", "lookup_seconds",
                                                                      "pool_lookup_seconds"} | {
        f"{kind}_{unit}" for kind in ("load", "push_load", "save", "pool_load", "pool_save")
        for unit in ("seconds", "bytes")}
    for path in DOC_FILES:
        for name in re.findall(r"vllm:mooncake_kv_([a-z][a-z_]*[a-z])", path.read_text(encoding="utf-8")):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert base in known, f"{path.name} names vllm:mooncake_kv_{name}, which the connector does not export"


# ---------------------------------------------------------------- the README's commands
def shell_commands(path: Path) -> list[list[str]]:
    """Every command of the fenced shell blocks (bash, sh or none), as tokens: continuations joined, comments and
    operators split off."""
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M):
        if lang not in ("", "bash", "sh", "shell"):
            continue
        pending = ""
        for line in body.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(pending + line, comments=True)
            except ValueError:  # a quoted string goes on on the next line
                pending += line + "\n"
                continue
            pending = ""
            command: list[str] = []
            for token in tokens:
                if token in OPERATORS:
                    commands.append(command)
                    command = []
                else:
                    command.append(token)
            commands.append(command)
    return [c for c in commands if c]


def program_and_args(command: list[str]) -> tuple[str, list[str]]:
    """The program a command runs (a script, for an interpreter) and its arguments; environment assignments skipped."""
    tokens = [t for t in command if not re.match(r"^[A-Z_][A-Z0-9_]*=", t)]
    if tokens and re.search(r"(^|/)python[0-9.]*$", tokens[0]) and len(tokens) > 1 and not tokens[1].startswith("-"):
        tokens = tokens[1:]
    return (tokens[0], tokens[1:]) if tokens else ("", [])


def accepted_flags(program: str) -> frozenset[str] | None:
    """The flags a program of this repository accepts; None for programs not ours (vllm, curl, ...)."""
    if program in ("proxy_server.py", "mooncake-kv-proxy"):
        return usage_flags("proxy_server.py")
    path = ROOT / program
    if program.endswith(".py") and path.is_file():
        return usage_flags(program)
    if program.endswith(".sh") and path.is_file():
        text = path.read_text(encoding="utf-8")
        flags = set(re.findall(r'"(--[a-z][a-z0-9-]*)"', text))  # what the script itself takes
        for script in re.findall(r"((?:scripts|benchmarks)/\w+\.py)[^\n]*\"\$@\"", text):  # what it hands on
            flags |= usage_flags(script)
        return frozenset(flags)
    return None


def test_the_readmes_commands_name_files_that_exist_and_flags_their_programs_accept() -> None:
    made: set[str] = set()
    checked_flags = 0
    commands = shell_commands(README)
    assert len(commands) >= 8, commands
    for command in commands:
        program, args = program_and_args(command)
        if program == "cp" and len(args) == 2:
            made.add(args[1])
        for token in [program, *args, *(t.split("=", 1)[1] for t in command if re.match(r"^[A-Z_]+=", t))]:
            if LOOKS_LIKE_FILE.match(token) and not token.startswith(SETUP_MADE) and token not in made:
                assert (ROOT / token).exists(), f"the README's {shlex.join(command)!r} names {token}: no such file"
        flags = accepted_flags(program)
        if flags is not None:
            for arg in args:
                if arg.startswith("--"):
                    assert arg.split("=", 1)[0] in flags, f"{program} does not accept {arg} (README: {shlex.join(command)!r})"
                    checked_flags += 1
    assert checked_flags >= 5, "no flag of ours was checked"


@pytest.mark.parametrize("path", DOC_FILES[1:], ids=lambda p: p.name)
def test_the_docs_commands_give_our_programs_flags_they_accept(path: Path) -> None:
    """The docs' commands are recipes with placeholders (MODEL, a host's own mooncake.json): only their flags are
    checked."""
    for command in shell_commands(path):
        program, args = program_and_args(command)
        flags = accepted_flags(program)
        for arg in args if flags is not None else ():
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in flags, f"{program} does not accept {arg} ({path.name}: {shlex.join(command)!r})"


# ---------------------------------------------------------------- paths and links
def exists(target: str) -> bool:
    return target.rstrip("/") in PENDING or target.split("/", 1)[0] in PENDING or (ROOT / target).exists()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_every_path_and_link_in_the_docs_resolves(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    for target in PATH_IN_TEXT.findall(text):
        assert exists(target), f"{path.name} names {target}, which does not exist"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve().relative_to(ROOT).as_posix() if file else path.relative_to(ROOT).as_posix()
        assert exists(resolved), f"{path.name} links to {target}, which does not exist"
        if anchor and (ROOT / resolved).is_file():
            headings = re.findall(r"^#+ (.+)$", (ROOT / resolved).read_text(encoding="utf-8"), re.M)
            assert anchor in {slug(h) for h in headings}, f"{path.name} links to {target}: no such heading"
