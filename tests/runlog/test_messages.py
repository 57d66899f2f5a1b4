"""Every message goes through Python's logging (the "raygpt" logger, raygpt.runlog.console):
`print` is left only where printing is the product, a command's own output (its result on
stdout, its one-line error on stderr, a progress line of `raygpt status --verify`)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raygpt"

# module -> the functions whose output is the command's own: nothing else may print
COMMAND_OUTPUT = {
    "raygpt/cli.py": {"_train"},                              # raygpt train's exit line
    "raygpt/ray/sweep_command.py": {"main"},                  # raygpt sweep's help and exit line
    "raygpt/runlog/status.py": {"status_main"},             # raygpt status
    "raygpt/runlog/plot.py": {"plot_main"},                 # raygpt plot
    "raygpt/runlog/run_view.py": {"_stderr_progress"},      # status and plot's progress lines
    "raygpt/ray/prepare.py": {"main"},                        # raygpt prepare's shard list
    "raygpt/runlog/compact.py": {"compact_main"},             # raygpt compact's report
    "raygpt/interop/trained.py": {"export_main", "sample_main", "eval_main"},  # export, sample, eval
    "raygpt/tools/local_s3.py": {"main"},                     # the bucket's environment, a command
}


def print_calls(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of each call of the builtin print in the file, at any depth;
    "" for module level."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id == "print"):
                found.append((function, child.lineno))
            visit(child, function)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_only_a_commands_own_output_is_printed():
    stray = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE.parent))
        allowed = COMMAND_OUTPUT.get(name, set())
        hits = [f"{line} (in {fn or 'module'})" for fn, line in print_calls(path)
                if fn not in allowed]
        if hits:
            stray[name] = hits
    assert stray == {}, f"print() outside a command's own output (use logging): {stray}"


def test_the_check_sees_print_calls(tmp_path):
    """The scan finds a print at module level, in a function and nested in a method (it would
    pass vacuously otherwise), and not a method or attribute that is merely named print."""
    probe = tmp_path / "probe.py"
    probe.write_text("print('a')\ndef f():\n    if True:\n        print('b')\n"
                     "class C:\n    def g(self):\n        x = lambda: print('c')\n"
                     "def h(p):\n    p.print_help()\n    p.print('d')\n")
    assert print_calls(probe) == [("", 1), ("f", 4), ("g", 7)]
    assert print_calls(PACKAGE / "cli.py")  # the CLI does print its result
