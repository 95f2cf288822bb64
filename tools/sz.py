"""The kernel's size in tokens (characters / 4), per folder and in total, checked against a budget.

Run ``python tools/sz.py``: prints tokens, docstring tokens and lines over 100 characters per folder
of molt/ and stages/, the longest functions, and exits 1 past any budget. Tokens, not lines, so that
packing code never pays. Raise a budget only on purpose, in its own commit, saying what it buys.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

BUDGET_TOKENS = {  # folder -> tokens (characters / 4) of its .py files, subfolders not included
    "molt": 11_700,
    "molt/runtime": 36_750,
    "molt/commands": 18_700,
    "molt/agents": 21_550,
    "molt/algorithms": 16_000,
    "molt/engines": 24_900,
    "molt/models": 10_700,
    "molt/tasks": 9_850,
    "molt/train": 27_900,
    "stages": 18_000,
}
BUDGET_TOTAL_TOKENS = 195_200  # molt/ + stages/
BUDGET_DOCSTRING_TOKENS = 40_000  # of the total
BUDGET_LONG_LINES = 25  # lines over 100 characters
BUDGET_FUNCTION_LINES = 60  # the longest function (STYLE: 90th percentile 40-60)
ROOTS = ("molt", "stages")


def docstring_chars(tree: ast.AST, text: str) -> int:
    """Characters of every module, class and function docstring in ``tree`` (parsed from ``text``)."""
    total = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                total += len(ast.get_source_segment(text, first) or "")
    return total


def report(root: Path) -> list[str]:
    """Print the tables; return the budget violations."""
    folders: dict[str, list[int]] = {}  # folder -> [characters, docstring characters, long lines]
    funcs: list[tuple[str, int]] = []
    for path in sorted(p for r in ROOTS for p in (root / r).rglob("*.py")):
        text, rel = path.read_text(), path.relative_to(root)
        tree = ast.parse(text)
        row = folders.setdefault(str(rel.parent), [0, 0, 0])
        row[0] += len(text)
        row[1] += docstring_chars(tree, text)
        row[2] += sum(len(line) > 100 for line in text.splitlines())
        funcs += [(f"{rel}:{n.lineno} {n.name}", n.end_lineno - n.lineno + 1)  # type: ignore[operator]
                  for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    bad = []
    print(f"{'folder':16s} {'tokens':>8s} {'budget':>8s} {'docs':>7s} {'>100ch':>7s}")
    for folder, (chars, doc, long) in sorted(folders.items()):
        budget = BUDGET_TOKENS.get(folder)
        print(f"{folder:16s} {chars // 4:8d} {budget or '-':>8} {doc // 4:7d} {long:7d}")
        if budget is None:
            bad.append(f"{folder}: no budget; add it to BUDGET_TOKENS")
        elif chars // 4 > budget:
            bad.append(f"{folder}: {chars // 4} tokens > {budget}")
    tokens, docs, long = (sum(r[i] for r in folders.values()) for i in range(3))
    print(f"{'total':16s} {tokens // 4:8d} {BUDGET_TOTAL_TOKENS:8d} {docs // 4:7d} {long:7d}")
    lengths = sorted(n for _, n in funcs)
    print(f"function lines: median {lengths[len(lengths) // 2]}, 90th percentile {lengths[int(len(lengths) * 0.9)]}")
    for name, n in sorted(funcs, key=lambda kv: -kv[1])[:5]:
        print(f"  {n:5d}  {name}")
    checks = [("total tokens", tokens // 4, BUDGET_TOTAL_TOKENS), ("docstring tokens", docs // 4, BUDGET_DOCSTRING_TOKENS),
              ("lines over 100 characters", long, BUDGET_LONG_LINES)]
    bad += [f"{what}: {n} > {budget}" for what, n, budget in checks if n > budget]
    bad += [f"{name}: {n} lines > {BUDGET_FUNCTION_LINES}" for name, n in funcs if n > BUDGET_FUNCTION_LINES]
    return bad


if __name__ == "__main__":
    violations = report(Path(__file__).resolve().parents[1])
    for v in violations:
        print("over budget:", v)
    sys.exit(1 if violations else 0)
