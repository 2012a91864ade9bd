"""The code's shape, checked like the layer contract: no function or method of the library or the
application above cyclomatic complexity 15 (radon's count; the benchmarks are exempt), and no
Python file of the library, the application or the benchmarks above 700 lines unless its
docstring says why it is one file (a paragraph starting "Why one file:"), and none above 900.
Caps are not the goal: nothing is split only to fit one. A failure names every offender, so that
one run shows all that is left to split."""

import ast
from pathlib import Path

from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parents[1]
MAX_COMPLEXITY = 15
MAX_LINES = 700
MAX_LINES_SAID_WHY = 900
SAYS_WHY = "Why one file:"
COMPLEXITY_PACKAGES = ("mtplx", "deployments")
LENGTH_PACKAGES = ("mtplx", "deployments", "benchmarks")


def _python_files(packages):
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _functions(blocks, prefix=""):
    """Every function and method radon found, closures and inner classes' methods included (radon
    counts a closure apart from the function around it): (qualified name, line, complexity)."""
    for block in blocks:
        name = prefix + block.name
        if hasattr(block, "methods"):          # a class
            yield from _functions(block.methods, name + ".")
            yield from _functions(block.inner_classes, name + ".")
        else:
            yield name, block.lineno, block.complexity
            yield from _functions(block.closures, name + ".")


def _top_level(blocks):
    """radon lists a class's methods beside the class itself; keep the class, which holds them."""
    return [b for b in blocks if getattr(b, "letter", "") != "M"]


def test_no_function_is_too_complex():
    offenders = []
    for path in _python_files(COMPLEXITY_PACKAGES):
        blocks = _top_level(cc_visit(path.read_text()))
        offenders += [(complexity, f"{path.relative_to(ROOT)}:{line} {name}")
                      for name, line, complexity in _functions(blocks) if complexity > MAX_COMPLEXITY]
    offenders.sort(reverse=True)
    assert not offenders, (f"{len(offenders)} functions above cyclomatic complexity {MAX_COMPLEXITY}:\n"
                           + "\n".join(f"  {c:3d}  {where}" for c, where in offenders))


def _cap(text: str) -> int:
    """A file's line cap: higher where its docstring says why it is one file."""
    docstring = ast.get_docstring(ast.parse(text)) or ""
    return MAX_LINES_SAID_WHY if SAYS_WHY in docstring else MAX_LINES


def test_no_file_is_too_long():
    offenders = []
    for path in _python_files(LENGTH_PACKAGES):
        text = path.read_text()
        n = len(text.splitlines())
        if n > _cap(text):
            offenders.append((n, path.relative_to(ROOT)))
    offenders.sort(reverse=True)
    assert not offenders, (f"{len(offenders)} files above {MAX_LINES} lines whose docstring does not say why "
                           f"they are one file, or above {MAX_LINES_SAID_WHY}:\n"
                           + "\n".join(f"  {n:5d}  {path}" for n, path in offenders))


def test_the_checks_see_closures_methods_and_long_files(tmp_path):
    """The walk reaches what radon nests: a closure and a method of an inner class are counted on
    their own, each with its own complexity."""
    branches = "".join(f"        if x == {i}:\n            return {i}\n" for i in range(MAX_COMPLEXITY))
    code = (f"def outer(x):\n    def inner(x):\n{branches}        return -1\n    return inner(x)\n\n\n"
            f"class Outer:\n    class Inner:\n        def method(self, x):\n"
            + branches.replace("\n        ", "\n            ").replace("        if", "            if", 1)
            + "            return -1\n")
    found = {name: complexity for name, _, complexity in _functions(_top_level(cc_visit(code)))}
    assert found == {"outer": 1, "outer.inner": MAX_COMPLEXITY + 1, "Outer.Inner.method": MAX_COMPLEXITY + 1}
