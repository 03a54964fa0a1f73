"""Rewrites LeRobot 0.6.1's Python 3.12-only type syntax into its Python 3.11 spelling, annotation-only:
`type X = ...` becomes `X = ...`, `class C[T](B):` becomes `class C(B, Generic[T]):` and `def f[T: B](...)` becomes
`def f(...)`, each with a module-level `TypeVar` for its parameters. Run over the installed site by `make test`
(lerobot 0.6.1 declares Python >= 3.12; this project runs 3.11). Idempotent. Compiles every .py of the installed
package afterwards and exits 1 naming each file that still does not parse.

usage: python tests/lerobot_env061/py311.py SITE
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# the files of lerobot 0.6.1 that use the syntax (measured: compile() of every file on 3.11); a file listed here
# that is missing means another LeRobot version was installed
EXPECTED = ["datasets/aggregate.py", "datasets/streaming_dataset.py", "motors/motors_bus.py",
            "processor/pipeline.py", "utils/io_utils.py"]
MARK = "  # py311.py"
_ALIAS = re.compile(r"^(\s*)type\s+([A-Za-z_]\w*)\s*=\s*(.*)$")
_CLASS = re.compile(r"^(\s*)class\s+([A-Za-z_]\w*)\[([^\]]*)\]\s*(?:\((.*)\))?\s*:(.*)$")
_DEF = re.compile(r"^(\s*)((?:async\s+)?def)\s+([A-Za-z_]\w*)\[([^\]]*)\]\s*\((.*)$")


def _typevars(indent: str, params: str, defined: set[str]) -> tuple[list[str], list[str]]:
    """`T`, `T: Bound` -> TypeVar lines (skipping names the module already defines as TypeVars), and the names."""
    lines, names = [], []
    for part in (p.strip() for p in params.split(",")):
        if not part:
            continue
        name, _, bound = (s.strip() for s in part.partition(":"))
        names.append(name)
        if name not in defined:
            arg = f", bound={bound}" if bound else ""
            lines.append(f'{indent}{name} = __import__("typing").TypeVar("{name}"{arg}){MARK}')
            defined.add(name)
    return lines, names


def rewrite(source: str) -> tuple[str, int]:
    """The source with its 3.12-only headers rewritten; how many were rewritten."""
    defined = set(re.findall(r"^([A-Za-z_]\w*)\s*=\s*(?:typing\.)?TypeVar\(", source, re.M))
    out, count = [], 0
    for line in source.splitlines(keepends=True):
        text = line.rstrip("\n")
        if m := _ALIAS.match(text):
            indent, name, value = m.groups()
            out.append(f"{indent}{name} = {value}{MARK}\n")
        elif m := _CLASS.match(text):
            indent, name, params, bases, rest = m.groups()
            tvs, names = _typevars(indent, params, defined)
            generic = f'__import__("typing").Generic[{", ".join(names)}]'
            bases = f"{bases}, {generic}" if bases and bases.strip() else generic
            out += [t + "\n" for t in tvs] + [f"{indent}class {name}({bases}):{rest}{MARK}\n"]
        elif m := _DEF.match(text):
            indent, kw, name, params, rest = m.groups()
            tvs, _ = _typevars(indent, params, defined)
            out += [t + "\n" for t in tvs] + [f"{indent}{kw} {name}({rest}{MARK}\n"]
        else:
            out.append(line)
            continue
        count += 1
    return "".join(out), count


def main(site: Path) -> int:
    package = site / "lerobot"
    missing = [f for f in EXPECTED if not (package / f).is_file()]
    if missing:
        print(f"py311.py: {package} lacks {missing}: not lerobot 0.6.1?", file=sys.stderr)
        return 1
    changed = 0
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        try:
            compile(source, str(path), "exec")
            continue
        except SyntaxError:
            pass
        new, count = rewrite(source)
        if count:
            path.write_text(new, encoding="utf-8")
            changed += 1
            print(f"py311.py: {path.relative_to(site)}: {count} header(s) rewritten")
    broken = []
    for path in sorted(package.rglob("*.py")):
        try:
            compile(path.read_text(encoding="utf-8"), str(path), "exec")
        except SyntaxError as e:
            broken.append(f"{path.relative_to(site)}:{e.lineno}: {e.msg}")
    if broken:
        print("py311.py: still not Python 3.11 after the rewrite:\n  " + "\n  ".join(broken), file=sys.stderr)
        return 1
    print(f"py311.py: {changed} file(s) rewritten; every .py of {package} compiles on Python "
          f"{sys.version_info.major}.{sys.version_info.minor}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
