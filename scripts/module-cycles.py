#!/usr/bin/env python3
"""Fails when modules of a crate depend on each other in a circle.

    scripts/module-cycles.py [--allow FILE] [CRATE_SRC ...]   (default: crates/flashtier-engine/src)

The modules are the crate root's: a file (`log.rs`) or a folder (`layout/`, whose files are
one module's parts: they may use each other freely). A module depends on another when any of
its files names the other by path from the crate root: `use crate::log::Record`,
`crate::cleaner::clean_pass(...)`, or one item of a grouped `use crate::{a, b::c}`. (`super::`
and relative paths stay inside a module, and the engine's files name other modules only
through `crate::`.)

Two modules that use each other, or a longer circle, is what the engine's layering forbids:
a component must not import its caller. Each circle found is printed with the line that closes
every step of it, and the exit status is 1.

`--allow FILE` names dependencies known to close circles and being taken apart, one per line
(`engine -> log`, `#` comments): the check runs without them, reports each, and fails on any
circle left, and on a listed dependency that no longer exists, so the list only ever shrinks.
"""

import argparse
import re
import sys
from pathlib import Path

USE_RE = re.compile(r"\buse\s+crate::([^;]+);", re.S)
PATH_RE = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)")


def module_name(src: Path, path: Path) -> str:
    """The crate-root module a file belongs to ("crate" for the root file itself)."""
    rel = path.relative_to(src).with_suffix("")
    top = rel.parts[0]
    return "crate" if top in ("lib", "main") else top


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r"//.*", "", line) for line in text.splitlines())


def expand_use(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (enough of the grammar for our code)."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix: str, t: str) -> None:
        if "{" not in t:
            for item in split_top(t):
                item = re.sub(r"\bas\b.*", "", item)
                out.append(prefix + item)
            return
        head, _, rest = t.partition("{")
        body = rest[: rest.rfind("}")]
        for item in split_top(body):
            walk(prefix + head, item)

    walk("", tree)
    return out


def split_top(t: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in t:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return [p for p in parts if p]


def deps_of(src: Path) -> dict[str, dict[str, str]]:
    """Per module, the modules it names, each with the first place it does."""
    files = sorted(src.rglob("*.rs"))
    modules = {module_name(src, f) for f in files}
    deps: dict[str, dict[str, str]] = {m: {} for m in modules if m != "crate"}
    for f in files:
        here = module_name(src, f)
        if here == "crate":
            continue
        text = strip_comments(f.read_text())
        refs = []
        for m in USE_RE.finditer(text):
            for item in expand_use(m.group(1)):
                refs.append((item.split("::")[0], m.start()))
        for m in PATH_RE.finditer(text):
            refs.append((m.group(1), m.start()))
        for target, pos in refs:
            if target in deps and target != here:
                where = f"{f.relative_to(src)}:{text.count(chr(10), 0, pos) + 1}"
                deps[here].setdefault(target, where)
    return deps


def cycles(deps: dict[str, dict[str, str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one circle through it."""
    index, low, stack, on, sccs = {}, {}, [], set(), []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in deps[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(deps):
        if v not in index:
            strong(v)
    out = []
    for comp in sccs:
        out.extend(circles_in(comp, deps))
    return out


def circles_in(comp: list[str], deps: dict[str, dict[str, str]]) -> list[list[str]]:
    """The shortest circle through each module of the component, without repeats."""
    members = set(comp)
    seen, out = set(), []
    for start in comp:
        # Breadth-first back to `start`.
        prev = {start: None}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(deps[v]):
                    if w not in members:
                        continue
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        if found is None:
            continue
        path = [found]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        path.reverse()
        key = frozenset(zip(path, path[1:] + path[:1]))
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def render(circle: list[str]) -> str:
    return " -> ".join(circle + [circle[0]])


def canonical(circle: list[str]) -> str:
    k = circle.index(min(circle))
    return render(circle[k:] + circle[:k])


def self_test() -> None:
    """The check finds what it must: a direct pair, a longer circle through a folder module and
    a grouped `use`, and nothing where the layering holds."""
    import tempfile

    def crate(files: dict[str, str]) -> dict[str, dict[str, str]]:
        d = Path(tempfile.mkdtemp())
        for name, text in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
        return deps_of(d)

    layered = crate({
        "lib.rs": "mod a; mod b; mod c;",
        "a.rs": "use crate::b::X;\nfn f() { crate::c::g(); }",
        "b.rs": "use crate::c::{self, Y};\n// crate::a::never (a comment)",
        "c/mod.rs": "mod d; use d::Z; use super::nothing;",
        "c/d.rs": "use super::Z; /* crate::a */",
    })
    assert cycles(layered) == [], cycles(layered)
    pair = crate({"a.rs": "use crate::b::X;", "b.rs": "fn f() { crate::a::g() }"})
    assert [canonical(c) for c in cycles(pair)] == ["a -> b -> a"], cycles(pair)
    circle = crate({
        "a.rs": "use crate::{x::Q, b::{self, X}};",
        "b.rs": "use crate::c::d::Z;",
        "c/d.rs": "use crate::a::W;",
    })
    assert [canonical(c) for c in cycles(circle)] == ["a -> b -> c -> a"], cycles(circle)
    print("module-cycles self-test: ok")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", nargs="*", default=["crates/flashtier-engine/src"])
    ap.add_argument("--allow", type=Path)
    ap.add_argument("--self-test", action="store_true", help="check the checker, then exit")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return 0
    allowed: set[tuple[str, str]] = set()
    if args.allow:
        for line in args.allow.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                a, _, b = line.partition("->")
                allowed.add((a.strip(), b.strip()))
    failed = False
    for src in map(Path, args.src):
        deps = deps_of(src)
        for a, b in sorted(allowed):
            if b in deps.get(a, {}):
                print(f"known dependency closing a circle (being taken apart): {a} -> {b} "
                      f"({src}/{deps[a].pop(b)})")
            else:
                failed = True
                print(f"{a} -> {b} is listed in {args.allow} but gone: remove it from there")
        found = {canonical(c): c for c in cycles(deps)}
        for key, circle in sorted(found.items()):
            failed = True
            print(f"module circle: {key}")
            for a, b in zip(circle, circle[1:] + circle[:1]):
                print(f"    {a} uses {b} ({src}/{deps[a][b]})")
        if not found:
            print(f"{src}: no module circles" + (" beyond the known ones" if allowed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
