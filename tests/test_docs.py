"""README.md and docs/ stay true to the repository: every relative link resolves (a `#anchor` to a
heading of its page), every `raygpt ...`, `python -m raygpt ...` and `python experiments/...`
command line they quote parses against the real command's argparse parser
(`raygpt.cli.parser_for`, nothing run, no Ray started), and CI runs README's test command.

A quoted command may use placeholders for values (`RUN_DIR`, `N`, `s3://YOUR-BUCKET/...`), `...`
for elided arguments and `[-o OUT.png]` for optional ones; a flag is always checked, so a flag
renamed in raygpt/config.py and not in the docs fails here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from raygpt.cli import COMMANDS, parser_for

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINKED_PAGES = sorted([*PAGES, *(ROOT / "bench").rglob("*.md")])  # bench's journals: links only

# `python -m MODULE` that is a raygpt command line, and the command it is
MODULES = {"raygpt": None, "raygpt.cli": None, "raygpt.ray.sweep": "sweep",
           "raygpt.ray.prepare": "prepare"}
# experiments/SCRIPT.py and the command it runs (the script's own main says which)
SCRIPTS = {"shakespeare.py": "train", "sweep_shakespeare.py": "sweep", "fineweb_edu.py": "train"}
# scripts with options of their own (their build_parser) before the command's flags
RECIPES = {"fineweb_edu.py"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # RUN_DIR, N, JOB_ID: a value left to the reader
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>", "<", "(", ")", "&"}


# ------------------------------------------------------------------ reading a markdown page

@dataclass
class Page:
    path: Path
    code_lines: list[tuple[int, str]]   # (line number, logical line) of code blocks
    prose: list[tuple[int, str]]        # (first line number, paragraph joined into one line)
    headings: list[str]


def read_page(path: Path) -> Page:
    """A page split into code-block lines (fenced or indented; `\\` continuations joined) and
    prose paragraphs (lines joined, so an inline span that wraps is one span)."""
    code, prose, headings = [], [], []
    fenced = False
    indented = False
    paragraph: list[str] = []
    start = 0
    pending = ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        blank = not line.strip()
        if not fenced and not indented and line.startswith("    ") and not paragraph:
            indented = True
        elif indented and not blank and not line.startswith("    "):
            indented = False
        if fenced or (indented and not blank):
            text = line[4:] if indented else line
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            code.append((n, pending + text))
            pending = ""
            continue
        if blank:
            if paragraph:
                prose.append((start, " ".join(paragraph)))
            paragraph = []
            continue
        if re.match(r"#{1,6} ", line):
            headings.append(line.lstrip("#").strip())
        if not paragraph:
            start = n
        paragraph.append(line.strip())
    if paragraph:
        prose.append((start, " ".join(paragraph)))
    return Page(path, code, prose, headings)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(page: Page) -> list[tuple[int, str]]:
    """(line, target) of every relative markdown link in the page's prose (not in code)."""
    out = []
    for n, text in page.prose:
        text = re.sub(r"`[^`]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                out.append((n, target))
    return out


# ------------------------------------------------------------------ finding quoted commands

@dataclass
class Quoted:
    where: str          # page:line
    text: str           # as quoted
    command: str | None  # raygpt's command (None: `raygpt` itself)
    argv: list[str]
    inline: bool        # an inline `span` (may mention a command without its positionals)


def tokens(text: str) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def at_command_position(toks: list[str], i: int) -> bool:
    """Whether toks[i] is where the shell reads a command: first, after an operator or a
    `ray job submit ... --`, or after `NAME=value` assignments."""
    k = i - 1
    while k >= 0 and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", toks[k]):
        k -= 1
    return k < 0 or toks[k] in SHELL_OPERATORS or toks[k] == "--"


def commands_in(text: str, where: str, inline: bool) -> list[Quoted]:
    """Every raygpt command line in one code line or inline span."""
    if not re.search(r"\b(raygpt|python3?)\b", text):
        return []
    try:
        toks = tokens(text)
    except ValueError:  # an unbalanced quote: prose (`raygpt compact`'s merge), not a command
        toks = text.split()
    found = []
    for i, tok in enumerate(toks):
        if not at_command_position(toks, i):
            continue  # prose in a code block: "Ray Tune sweeps over raygpt runs"
        rest = None
        if tok == "raygpt" and i + 1 < len(toks):
            nxt = toks[i + 1]
            if nxt in SHELL_OPERATORS or nxt.endswith(":"):
                continue  # console output (`raygpt | ...`, `raygpt status: error: ...`)
            rest = toks[i + 1:]
        elif tok in ("python", "python3") and i + 2 < len(toks) and toks[i + 1] == "-m" \
                and toks[i + 2] in MODULES:
            sub = MODULES[toks[i + 2]]
            rest = ([sub] if sub else []) + toks[i + 3:]
        elif tok in ("python", "python3") and i + 1 < len(toks) \
                and re.match(r"(\S*/)?experiments/\w+\.py$", toks[i + 1]):
            script = toks[i + 1].rpartition("/")[2]
            assert script in SCRIPTS and (ROOT / "experiments" / script).exists(), \
                f"{where}: {toks[i + 1]}: no such experiment script"
            rest = [SCRIPTS[script]] + (recipe_rest(script, toks[i + 2:]) if script in RECIPES
                                        else toks[i + 2:])
        if rest is None:
            continue
        end = next((k for k, t in enumerate(rest) if t in SHELL_OPERATORS), len(rest))
        rest = rest[:end]
        command = rest[0] if rest and rest[0] in COMMANDS else None
        found.append(Quoted(where, text, command, rest[1:] if command else rest, inline))
    return found


def recipe_rest(script: str, argv: list[str]) -> list[str]:
    """What a recipe script passes on to its command: argv less the script's own options (an
    option it does not know is passed on, and fails there as it would for a user)."""
    spec = importlib.util.spec_from_file_location(script[:-3], ROOT / "experiments" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser().parse_known_args(argv)[1]


def quoted_commands() -> list[Quoted]:
    out = []
    for path in PAGES:
        page = read_page(path)
        name = path.relative_to(ROOT)
        for n, line in page.code_lines:
            out += commands_in(line, f"{name}:{n}", inline=False)
        for n, text in page.prose:
            for span in re.findall(r"`([^`]+)`", text):
                out += commands_in(span, f"{name}:{n}", inline=True)
    return out


# ------------------------------------------------------------------ checking one against argparse

class UsageError(Exception):
    pass


def _raise(message):
    raise UsageError(message)


def without_placeholders(argv: list[str], parser) -> list[str]:
    """argv with `...` dropped, `[-o OUT]` unbracketed, `[things]` dropped, and a placeholder
    value after a typed or choice flag replaced by a value that flag takes."""
    out, skipping = [], False
    for tok in argv:
        if tok == "...":
            continue
        if tok.startswith("[") and not tok.startswith("[-"):
            skipping = not tok.endswith("]")
            continue
        if skipping:
            skipping = not tok.endswith("]")
            continue
        tok = tok.strip("[]")
        action = parser._option_string_actions.get(out[-1]) if out else None
        if PLACEHOLDER.match(tok) and action is not None:
            if action.choices:
                tok = str(next(iter(action.choices)))
            elif action.type in (int, float):
                tok = "1"
        out.append(tok)
    return out


def check(q: Quoted) -> str | None:
    """None if the quoted command parses; else why not, in one line."""
    parser = parser_for(q.command)
    parser.error = _raise  # raise, not print and exit, on a usage error
    argv = without_placeholders(q.argv, parser)
    for tok in argv:  # an unknown flag, whatever else the span leaves out
        flag = tok.split("=", 1)[0]
        if flag.startswith("-") and not re.match(r"-\d", flag) and flag != "-" \
                and flag not in parser._option_string_actions:
            return f"{q.where}: `{q.text}`: no flag {flag} in `raygpt {q.command or ''}`"
    if q.inline and not argv:
        return None  # a mention of the command (`raygpt status`), not a command line
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:  # --help, --version
        return None if not e.code else f"{q.where}: `{q.text}`: exit {e.code}"
    except Exception as e:  # noqa: BLE001 (UsageError, or raygpt's ConfigError for a usage error)
        if q.inline and "arguments are required" in str(e):
            return None  # an inline mention that leaves out the positionals
        return f"{q.where}: `{q.text}`: {e}"
    return None


# ------------------------------------------------------------------ the tests

def test_every_relative_link_resolves():
    bad = []
    for path in LINKED_PAGES:
        page = read_page(path)
        for n, target in links(page):
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif frag and dest.suffix == ".md" and frag not in {anchor(h) for h in read_page(dest).headings}:
                bad.append(f"{where}: no heading #{frag} in {dest.relative_to(ROOT)}")
    assert not bad, "\n".join(bad)


def test_every_quoted_command_parses():
    quoted = quoted_commands()
    assert len(quoted) > 40  # the finder finds them (README and docs quote dozens)
    bad = [why for q in quoted if (why := check(q))]
    assert not bad, "\n".join(bad)


def test_every_flag_named_in_prose_exists():
    """An inline span that starts with a flag (`--max-failures`, `-y 1`) names a flag of a raygpt
    command, of a bench script (read from its source) or of Ray's CLI."""
    known = set().union(*(parser_for(c)._option_string_actions for c in [None, *COMMANDS]))
    known |= {f for path in (ROOT / "bench").glob("*.py")
              for f in re.findall(r"[\"'](--[a-z][\w-]*)[\"']", path.read_text())}
    known |= {"--dashboard-host"}  # `ray start`'s
    known |= {f for path in (ROOT / "raygpt" / "tools").glob("[a-z]*.py")  # python -m raygpt.tools.X
              for f in importlib.import_module(f"raygpt.tools.{path.stem}").parser()._option_string_actions}
    bad = []
    for path in PAGES:
        for n, text in read_page(path).prose:
            for span in re.findall(r"`([^`]+)`", text):
                flag = re.match(r"--?[a-z][\w-]*", span)
                if flag and flag.group() not in known:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: `{span}`: no such flag")
    assert not bad, "\n".join(bad)


# A file of this repository named where a user reads what to run or read (the pages, the
# experiments' own usage, CI, the cluster config): raygpt/..., experiments/..., docs/... with a suffix
REPO_PATH = re.compile(r"(?<![\w./-])((?:raygpt|experiments|bench|tests|docs|iam|\.ci)/[\w./-]*\w"
                       r"\.(?:py|md|sh|yaml|toml|json|txt|bin))(?![\w/])")
USER_FACING = sorted([*PAGES, ROOT / "SECURITY.md", *(ROOT / "experiments").glob("*.py"),
                      ROOT / ".ci" / "run", ROOT / "cluster.yaml"])


def named_paths(text: str) -> list[str]:
    return [m.group(1) for m in REPO_PATH.finditer(text)]


def test_every_repository_path_named_for_users_exists():
    """experiments/sweep_shakespeare.py once sent its reader to raygpt/sweep.py, gone since."""
    named = [(path, n, p) for path in USER_FACING
             for n, line in enumerate(path.read_text().splitlines(), 1) for p in named_paths(line)]
    assert len(named) > 100  # the pages name files by the hundred
    bad = [f"{path.relative_to(ROOT)}:{n}: {p}: no such file" for path, n, p in named
           if not (ROOT / p).exists()]
    assert not bad, "\n".join(bad)
    assert named_paths("see raygpt/sweep.py and (raygpt/ray/sweep.py).") == [
        "raygpt/sweep.py", "raygpt/ray/sweep.py"]


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    readme_code = [line for _, line in read_page(ROOT / "README.md").code_lines]
    assert ci[-1] in readme_code


@pytest.mark.parametrize("text, fails", [
    ("raygpt train -x 20 --num-workers 2", False),
    ("raygpt train --num-worker 2", True),            # a renamed flag
    ("raygpt train -k cos", True),                    # a value outside the flag's choices
    ("raygpt train --max-failures N", False),         # a placeholder value
    ("raygpt status RUN_DIR --verify", False),
    ("raygpt plot RUN_DIR --verfy", True),
    ("python experiments/shakespeare.py -y 1 --bogus", True),
    ("python experiments/sweep_shakespeare.py --grid learning_rate=1e-3,3e-3 -x 50", False),
    ("raygpt sweep -o runs/sweep --grid-search x=1", True),
    ("raygpt --version", False),
])
def test_the_check_catches_a_wrong_flag(text, fails):
    """The checker itself: a wrong flag or choice fails, a placeholder value does not."""
    (q,) = commands_in(text, "example", inline=False)
    assert (check(q) is not None) == fails, check(q)


def test_the_finder_reads_wrapped_spans_and_continued_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `raygpt\nstatus RUN_DIR` now.\n\n    raygpt train -x 20 \\\n"
                    "        --num-workers 2   # two workers\n\n    raygpt | d12: output\n")
    p = read_page(page)
    found = [c for _, line in p.code_lines for c in commands_in(line, "x", inline=False)]
    found += [c for _, t in p.prose for s in re.findall(r"`([^`]+)`", t)
              for c in commands_in(s, "x", inline=True)]
    assert [(c.command, c.argv) for c in found] == [
        ("train", ["-x", "20", "--num-workers", "2"]), ("status", ["RUN_DIR"])]
