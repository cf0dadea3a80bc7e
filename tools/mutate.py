"""python tools/mutate.py MODULE [MODULE ...] --tests NODE [NODE ...] [--tests-from REV]
                           [--deselect NODE ...] [--lines N ...] [--max N] [--seed S]
                           [--timeout SECONDS] [--json FILE]

A mutation score: small changes made one at a time to the modules named (each mutant a copy of
the repository with one change), each run against the tests named (pytest node ids or files);
a mutant is killed when they fail (or time out), and survives when they pass. It prints the
share killed per module and every survivor (file:line, what changed), to be answered by a test
that kills it or a sentence on why it is equivalent.

The changes (``MUTATIONS``): a comparison turned (``<`` and ``<=``, ``>`` and ``>=``, ``==`` and
``!=``, ``in`` and ``not in``, ``is`` and ``is not``), ``and`` and ``or`` swapped, a ``not``
dropped, ``+`` and ``-`` swapped, ``*`` and ``/``... (``//``), an integer constant plus one,
``True`` and ``False`` swapped, a ``raise`` made ``pass``, a ``return`` made ``return None``.
Docstrings and ``__all__`` are left alone. ``--max`` draws that many mutants of each module
(seeded) where it has more; ``--lines`` keeps the mutants of those lines only (to check that a new
test kills a survivor). ``--tests-from REV`` runs the tests of an older commit (its
``tests/``) against the same mutants: the score before a change to the tests.

The unmutated copy must pass the tests first (else nothing is measured). Each mutant costs a
run of the tests: name the few that cover the module (the run takes minutes per dozen).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("zero1_mpi", "tests", "tools", "examples", "docs", "pyproject.toml", "README.md",
          "CHANGELOG.md")
SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
         ast.IsNot: ast.Is, ast.And: ast.Or, ast.Or: ast.And, ast.Add: ast.Sub, ast.Sub: ast.Add,
         ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}
MUTATIONS = "comparison, and/or, not, +/-, * and /, integer + 1, True/False, raise, return"


@dataclass
class Mutant:
    path: str
    line: int
    what: str
    index: int  # the node's place in ast.walk order, and which change of it
    change: int
    outcome: str = ""
    seconds: float = 0.0


def _skipped(tree) -> set:
    """Nodes not to mutate: docstrings and ``__all__``."""
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            skip.update(id(n) for n in ast.walk(body[0]))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _changes(node) -> list[str]:
    """What each change of ``node`` would do, in words (none: not mutated)."""
    if isinstance(node, ast.Compare):
        return [f"{type(op).__name__} -> {SWAPS[type(op)].__name__}" for op in node.ops
                if type(op) in SWAPS]
    if isinstance(node, ast.BoolOp):
        return [f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ["not dropped"]
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in SWAPS:
        return [f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [f"{node.value} -> {node.value + 1}"]
    if isinstance(node, ast.Constant) and type(node.value) is bool:
        return [f"{node.value} -> {not node.value}"]
    if isinstance(node, ast.Raise):
        return ["raise -> pass"]
    if isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        return ["return -> return None"]
    return []


class _Apply(ast.NodeTransformer):
    def __init__(self, index, change):
        self.index, self.change, self.seen = index, change, -1

    def visit(self, node):
        self.seen += 1
        if self.seen != self.index:
            return self.generic_visit(node)
        if isinstance(node, ast.Compare):
            ops = [i for i, op in enumerate(node.ops) if type(op) in SWAPS]
            at = ops[self.change]
            node.ops[at] = SWAPS[type(node.ops[at])]()
        elif isinstance(node, ast.BoolOp):
            node.op = SWAPS[type(node.op)]()
        elif isinstance(node, ast.UnaryOp):
            return node.operand
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            node.op = SWAPS[type(node.op)]()
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            node.value += 1
        elif isinstance(node, ast.Constant):
            node.value = not node.value
        elif isinstance(node, ast.Raise):
            return ast.Pass()
        elif isinstance(node, ast.Return):
            node.value = None
        return node


def _walk_ordered(tree):
    """``ast.walk`` in the order ``NodeTransformer.visit`` sees the nodes (depth first)."""
    order = []

    def visit(node):
        order.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(tree)
    return order


def mutants_of(path: str, root: Path = ROOT) -> list[Mutant]:
    tree = ast.parse((root / path).read_text())
    skip, found = _skipped(tree), []
    for index, node in enumerate(_walk_ordered(tree)):
        if id(node) in skip:
            continue
        for change, what in enumerate(_changes(node)):
            found.append(Mutant(path, node.lineno, what, index, change))
    return found


def mutated_source(m: Mutant, source: str) -> str:
    tree = _Apply(m.index, m.change).visit(ast.parse(source))
    return ast.unparse(ast.fix_missing_locations(tree))


def run_tests(copy: Path, tests, timeout: float, deselect=()) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "tests")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", *tests,
                               *(f"--deselect={node}" for node in deselect)], cwd=copy, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "killed (timeout)"
    return "survived" if done.returncode == 0 else "killed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[3])
    parser.add_argument("modules", nargs="+")
    parser.add_argument("--tests", nargs="+", required=True)
    parser.add_argument("--tests-from", metavar="REV")
    parser.add_argument("--deselect", nargs="+", default=[], metavar="NODE",
                        help="tests left out (one the unmutated copy fails: a behaviour changed "
                        "since --tests-from)")
    parser.add_argument("--lines", nargs="+", type=int, default=[], metavar="N")
    parser.add_argument("--max", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "copy"
        copy.mkdir()
        for part in COPIED:
            source = ROOT / part
            if source.is_dir():
                shutil.copytree(source, copy / part, ignore=shutil.ignore_patterns(
                    "__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, copy / part)
        if args.tests_from:
            shutil.rmtree(copy / "tests")
            archive = subprocess.run(["git", "archive", args.tests_from, "tests"], cwd=ROOT,
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
        baseline = run_tests(copy, args.tests, args.timeout, args.deselect)
        if baseline != "survived":
            print(f"the tests fail on the unmutated copy ({baseline}): nothing to measure")
            return 2
        results = []
        for path in args.modules:
            # (from the copy: the repository may be edited while this runs)
            every = [m for m in mutants_of(path, copy) if not args.lines or m.line in args.lines]
            chosen = every if not args.max or len(every) <= args.max else sorted(
                random.Random(args.seed).sample(every, args.max), key=lambda m: m.line)
            original = (copy / path).read_text()
            for m in chosen:
                start = time.monotonic()
                (copy / path).write_text(mutated_source(m, original))
                m.outcome = run_tests(copy, args.tests, args.timeout, args.deselect)
                m.seconds = round(time.monotonic() - start, 1)
                (copy / path).write_text(original)
                print(f"{m.path}:{m.line}: {m.what}: {m.outcome} ({m.seconds} s)", flush=True)
            killed = sum(m.outcome.startswith("killed") for m in chosen)
            print(f"== {path}: {killed} of {len(chosen)} mutants killed "
                  f"({100 * killed / max(1, len(chosen)):.0f}%; {len(every)} in all)", flush=True)
            results += chosen
    for m in results:
        if m.outcome == "survived":
            print(f"SURVIVED {m.path}:{m.line}: {m.what}")
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for m in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
