"""README.md and docs/*.md stay true.

- Every `python train_ppo.py ...` / `torchrun ... train_ppo.py ...` command in a shell code block or an
  inline code span parses with the trainer's own flags (`train_ppo.parse_args`, in-process), and every
  `--flag` it names is one of the trainer's flags by its full name (argparse would accept a prefix).
- Every `python scripts/X.py ...` command (and `builders/`, `benchmarks/`, `examples/X.py`) names an existing
  script whose `--help` exits 0, and every `--flag` it names is listed by that `--help` (of its subcommand,
  for convert_model.py to_hf / to_native).
- Every relative link (`[text](path)` or `![alt](path)`) points to an existing file, and an anchor
  (`path#heading`) to an existing heading.
- Every repository file named in an inline code span (`trainer/ppo.py`, `tests/test_lora.py`, ...) exists.
- README.md links every docs/*.md page and stays a front door: at most 260 lines. Its set-up block is two commands
  (the virtualenv a comment above them), and its pytest commands are the ones .ci/run runs, in order.

Placeholders are filled in before parsing: `<RM dir>` becomes a dummy value, `...same flags...` and
`...` are dropped. A command that loads a `--config FILE` which does not exist yet is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 260

# Files the typed-config refactor is creating; a link to one of them may dangle until it lands.
PENDING: set[str] = set()

# Paths in the pages that name another project's files (MiniMind's trainer), not this repository's.
EXTERNAL = {"trainer/train_ppo.py", "trainer/train_agent.py", "trainer/train_grpo.py"}
REPO_PATH = re.compile(r"(?:trainer|model|dataset|scripts|builders|benchmarks|examples|tests|configs|docs)/"
                       r"[\w/.-]+\.(?:py|md|yaml|yml|json|jsonl|jinja|txt)")

SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
WRAPPERS = {"srun", "env", "nohup", "time", "exec"}  # may precede the command itself
PROGRAMS = {"python", "python3", "torchrun"}
# The folders whose files the pages run as `python <folder>/X.py` (docs/layout.md: one per audience).
SCRIPT_DIRS = ("scripts/", "builders/", "benchmarks/", "examples/")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
FLAG = re.compile(r"^(--[A-Za-z][\w-]*)(=.*)?$")
HELP_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SWANLAB_MODE": "disabled"}


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ----------------------------------------------------------------------------------- markdown
def split_fences(text: str) -> tuple[list[tuple[int, str, list[str]]], list[tuple[int, str]]]:
    """([(first line no, language, lines)] of the fenced blocks, [(line no, line)] of the prose)."""
    blocks, prose, cur = [], [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if cur is None and m:
            cur = (no + 1, m.group(2).lower(), [], m.group(1))
        elif cur is not None and line.strip().startswith(cur[3]):
            blocks.append(cur[:3])
            cur = None
        elif cur is not None:
            cur[2].append(line)
        else:
            prose.append((no, line))
    assert cur is None, f"unclosed code block from line {cur[0] - 1}"
    return blocks, prose


def shell_lines(start: int, lines: list[str]) -> list[tuple[int, str]]:
    """The block's lines with backslash continuations joined, each with its first line's number."""
    out, buf, first = [], "", None
    for no, line in enumerate(lines, start):
        first = no if first is None else first
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((first, buf + line))
        buf, first = "", None
    if buf:
        out.append((first, buf))
    return out


def inline_spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Inline code spans of the prose (a span may wrap onto the next line, never across a blank one)."""
    spans, para = [], []
    for no, line in [*prose, (0, "")]:
        if line.strip():
            para.append((no, line))
            continue
        text = "\n".join(line for _, line in para)
        for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
            spans.append((para[text.count("\n", 0, m.start())][0], " ".join(m.group(1).split())))
        para = []
    return spans


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    kind: str  # "trainer" or "script"
    argv: tuple[str, ...]  # trainer: its flags; script: (script path, its arguments...)
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def fill_placeholders(cmd: str) -> str:
    cmd = re.sub(r"\.\.\.[A-Za-z][^.`]*?\.\.\.", " ", cmd)  # ...same flags...
    return re.sub(r"<([^<>]*)>", lambda m: (re.match(r"\d+", m.group(1)) or ["x"])[0], cmd)  # <RM dir>, <0|1>


def parse_command(page: str, line: int, cmd: str) -> list[Command]:
    try:
        tokens = shlex.split(fill_placeholders(cmd), comments=True)
    except ValueError:  # not shell (an unbalanced quote in prose)
        return []
    found, seg = [], []
    for tok in [*tokens, "&&"]:
        if tok not in ("&&", "||", ";", "|"):
            seg.append(tok)
            continue
        words = [t for t in seg if t != "..."]
        seg = []
        i = 0
        while i < len(words) and ENV_ASSIGNMENT.match(words[i]):
            i += 1
        if i < len(words) and words[i] in WRAPPERS:  # srun [its options] torchrun ...
            i = next((k for k in range(i, len(words)) if words[k] in PROGRAMS), len(words))
        words = words[i:]
        if not words:
            continue
        if words[0] == "torchrun":
            at = next((i for i, w in enumerate(words) if w.endswith("train_ppo.py")), None)
            if at is not None:
                found.append(Command(page, line, "trainer", tuple(words[at + 1:]), cmd))
        elif words[0] in ("python", "python3") and len(words) > 1:
            if words[1] in ("train_ppo.py", "./train_ppo.py"):
                found.append(Command(page, line, "trainer", tuple(words[2:]), cmd))
            elif words[1].removeprefix("./").startswith(SCRIPT_DIRS):
                found.append(Command(page, line, "script", tuple(words[1:]), cmd))
    return found


def page_commands(path: Path) -> list[Command]:
    blocks, prose = split_fences(path.read_text(encoding="utf-8"))
    cmds = []
    for start, lang, lines in blocks:
        if lang in SHELL_LANGS:
            for no, line in shell_lines(start, lines):
                cmds += parse_command(rel(path), no, line)
    for no, span in inline_spans(prose):
        if re.match(r"^([A-Za-z_]\w*=\S*\s+)*(srun\s.*)?(python3?|torchrun)\s", span):
            cmds += parse_command(rel(path), no, span)
    return cmds


COMMANDS = [c for page in PAGES for c in page_commands(page)]
TRAINER = [c for c in COMMANDS if c.kind == "trainer"]
SCRIPTS = [c for c in COMMANDS if c.kind == "script"]


def flags_of(argv: tuple[str, ...]) -> list[str]:
    return [m.group(1) for a in argv if (m := FLAG.match(a))]


def listed(flag: str, help_text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


# ----------------------------------------------------------------------------------- the trainer
@functools.cache
def trainer_help() -> str:
    import train_ppo

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            train_ppo.parse_args(["--help"])
    except SystemExit as e:
        assert e.code in (0, None), f"train_ppo.py --help exited {e.code}"
    return out.getvalue()


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def test_the_pages_have_commands() -> None:
    pages = {c.page for c in TRAINER}
    assert "README.md" in pages and len(TRAINER) >= 10 and len(SCRIPTS) >= 10, (len(TRAINER), len(SCRIPTS))


@pytest.mark.parametrize("cmd", TRAINER, ids=[c.id for c in TRAINER])
def test_trainer_command_parses(cmd: Command, capsys: pytest.CaptureFixture) -> None:
    import train_ppo

    argv = list(cmd.argv)
    config = flag_value(argv, "--config")
    pending = config is not None and not (ROOT / config).exists()  # a preset still being written
    unknown = [f for f in flags_of(cmd.argv) if not listed(f, trainer_help()) and not (pending and f == "--config")]
    assert not unknown, f"{cmd.id}: not train_ppo.py flags (full names): {unknown}\n  {cmd.text}"
    for i, a in enumerate(argv):  # a custom reward given as a file must exist
        if a == "--reward_fn" or a.startswith("--reward_fn="):
            value = flag_value(argv[i:], "--reward_fn") or ""
            if ".py:" in value:
                assert (ROOT / value.split(":")[0]).is_file(), f"{cmd.id}: {value} names a missing file"
    if pending:
        pytest.skip(f"{config} does not exist yet: flags checked, parse skipped")
    if "--help" in argv or "-h" in argv:
        with pytest.raises(SystemExit) as e:
            train_ppo.parse_args(argv)
        assert e.value.code in (0, None)
        return
    cwd = os.getcwd()
    os.chdir(ROOT)  # relative paths (--config) as a reader at the repository root sees them
    try:
        train_ppo.parse_args(argv)
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines()
        pytest.fail(f"{cmd.id}: train_ppo.parse_args({argv}) exited {e.code}: {err[-1] if err else ''}\n  {cmd.text}")
    finally:
        os.chdir(cwd)


# ----------------------------------------------------------------------------------- scripts
def script_parts(cmd: Command) -> tuple[str, str | None]:
    """(script path, subcommand or None)."""
    script = cmd.argv[0].removeprefix("./")
    sub = cmd.argv[1] if len(cmd.argv) > 1 and re.fullmatch(r"[a-z][a-z0-9_]*", cmd.argv[1]) else None
    if sub is not None and not re.search(rf"\{{[^}}]*\b{sub}\b[^}}]*\}}", script_help(script, None)):
        sub = None  # a positional argument, not a subcommand
    return script, sub


# Runs `<script> [sub] --help` for many scripts in one interpreter: torch and transformers are imported
# once, not once per script (each script as __main__, as `python scripts/X.py --help` runs it, or builders/...).
HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
out = {}
for script, sub in json.loads(sys.argv[1]):
    buf, err = io.StringIO(), io.StringIO()
    sys.argv = [script, *([sub] if sub else []), "--help"]
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    out[script + "|" + sub] = [code, buf.getvalue(), err.getvalue()[-2000:]]
print(json.dumps(out))
"""


@functools.cache
def _helps(keys: tuple[tuple[str, str], ...]) -> dict:
    r = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(keys)], cwd=ROOT, env=HELP_ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _script_names() -> list[str]:
    return sorted({c.argv[0].removeprefix("./") for c in SCRIPTS if (ROOT / c.argv[0].removeprefix("./")).is_file()})


def _subcommand_keys() -> tuple[tuple[str, str], ...]:
    """Every (script, subcommand) the pages use: a second argument the script's own help lists as a choice."""
    keys = set()
    for c in SCRIPTS:
        script = c.argv[0].removeprefix("./")
        if (ROOT / script).is_file() and len(c.argv) > 1 and re.fullmatch(r"[a-z][a-z0-9_]*", c.argv[1]):
            keys.add((script, c.argv[1]))
    return tuple(sorted(k for k in keys if re.search(rf"\{{[^}}]*\b{k[1]}\b[^}}]*\}}", script_help(k[0], None))))


def script_help(script: str, sub: str | None) -> str:
    keys = tuple((s, "") for s in _script_names()) if sub is None else _subcommand_keys()
    code, out, err = _helps(keys)[f"{script}|{sub or ''}"]
    assert code == 0, f"{script} {sub or ''} --help exited {code}:\n{err}"
    return out


@pytest.mark.parametrize("cmd", SCRIPTS, ids=[c.id for c in SCRIPTS])
def test_script_exists(cmd: Command) -> None:
    script = cmd.argv[0].removeprefix("./")
    assert (ROOT / script).is_file(), f"{cmd.id}: {script} does not exist\n  {cmd.text}"


def test_every_script_is_run_by_a_page() -> None:
    """Each script in scripts/, builders/ and benchmarks/ has a command in the pages, so its `--help` is run below
    (examples/ holds plug-ins the trainer loads, not scripts)."""
    run = {c.argv[0].removeprefix("./") for c in SCRIPTS}
    files = {rel(p) for d in ("scripts", "builders", "benchmarks") for p in (ROOT / d).glob("*.py")}
    assert not files - run, f"no page runs: {sorted(files - run)}"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted({c.argv[0].removeprefix("./") for c in SCRIPTS}))
def test_script_help_and_flags(script: str) -> None:
    """`--help` once per script (and subcommand); every flag the pages give it is listed there."""
    if not (ROOT / script).is_file():
        pytest.skip(f"{script} does not exist (test_script_exists fails)")
    bad = []
    for cmd in (c for c in SCRIPTS if c.argv[0].removeprefix("./") == script):
        _, sub = script_parts(cmd)
        text = script_help(script, sub)
        bad += [f"{cmd.id}: {f}" for f in flags_of(cmd.argv[1:]) if not listed(f, text)]
    assert not bad, f"flags that {script} --help does not list:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------- links
def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    _, prose = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return frozenset(out)


def links(path: Path) -> list[tuple[int, str]]:
    _, prose = split_fences(path.read_text(encoding="utf-8"))
    text = "\n".join(line for _, line in prose)
    text = re.sub(r"(?<!`)`[^`]+`(?!`)", lambda m: " " * len(m.group(0)) if "\n" not in m.group(0) else m.group(0), text)
    line_of = [no for no, _ in prose]
    return [(line_of[text.count("\n", 0, m.start())], m.group(1))
            for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)]


@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_links_resolve(page: Path) -> None:
    bad = []
    for no, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if path and not dest.exists():
            if not dest.is_relative_to(ROOT) or dest.relative_to(ROOT).as_posix() not in PENDING:
                bad.append(f"{rel(page)}:{no}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel(page)}:{no}: {target}: no heading #{anchor} in {rel(dest)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_inline_paths_exist(page: Path) -> None:
    _, prose = split_fences(page.read_text(encoding="utf-8"))
    bad = [f"{rel(page)}:{no}: {span}" for no, span in inline_spans(prose)
           if REPO_PATH.fullmatch(span) and span not in EXTERNAL | PENDING and not (ROOT / span).exists()]
    assert not bad, "files named that do not exist:\n" + "\n".join(bad)


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for _, t in links(README) if not t.startswith(("http:", "https:"))}
    missing = [rel(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_readme_is_a_front_door() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: move details to docs/)"


def _readme_setup_block() -> list[str]:
    """The set-up block's lines: the code block that installs requirements.txt."""
    blocks, _ = split_fences(README.read_text(encoding="utf-8"))
    return next(lines for _, lang, lines in blocks if any("pip install -r requirements.txt" in ln for ln in lines))


def _readme_test_commands() -> list[str]:
    """The README's test commands: its shell lines that run pytest, in order."""
    blocks, _ = split_fences(README.read_text(encoding="utf-8"))
    return [cmd for _, lang, lines in blocks if lang in SHELL_LANGS
            for ln in lines if (cmd := ln.split("#", 1)[0].strip()).startswith("python -m pytest")]


def test_readme_setup_is_two_commands() -> None:
    """The set-up block promises two commands (install, run the demo); the virtualenv is a comment above them."""
    setup = _readme_setup_block()
    commands = [c for ln in setup if (c := ln.split("#", 1)[0].strip())]
    assert commands == ["pip install -r requirements.txt", "python train_ppo.py"], commands
    assert "python3 -m venv " in setup[0] and setup[0].lstrip().startswith("#"), setup[0]


def test_ci_installs_as_the_readme_says_and_runs_its_test_commands() -> None:
    """.ci/run makes a fresh venv (no system site-packages), installs requirements.txt into it and runs the
    README's test commands, the same ones, in the same order."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^python3 -m venv \"\$venv\"$", ci, re.M) and "--system-site-packages" not in ci
    assert re.search(r"^python -m pip install -r requirements\.txt$", ci, re.M)
    readme_tests = _readme_test_commands()
    ci_tests = re.findall(r'^\s+"(python -m pytest[^"]*)"$', ci, re.M)
    assert readme_tests and ci_tests == readme_tests, (ci_tests, readme_tests)
