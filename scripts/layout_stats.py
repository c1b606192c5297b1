#!/usr/bin/env python3
"""Layout statistics of a module tree of a Rust crate: files per folder, `use` imports that
run back up, and files that import each other.

Usage: scripts/layout_stats.py [-v] [DIR ...]      (default: src/ops; e.g. src/optim, src)

For every folder under DIR it prints
  files     the .rs files directly in it;
  imports   the crate-internal `use` statements of those files (`crate::`, `super::`, `self::`
            paths; `pub use` re-exports are the public face and not counted);
  back up   those of them that run back up: a path that climbs to an ancestor module inside DIR
            (say `super::` or `crate::ops::` from `ops/attention/flash.rs`) and takes an item
            defined or re-exported there (`check_float`, `Segments`), rather than naming a
            module and going down into it (`super::common::check_float`);
  inline    the same climbs written in code rather than in a `use` (`super::swiglu(&x)`).
Then the circles: pairs of files under DIR that reach each other (a `use` or a path in code
naming an item of the other file, re-exports followed), which folders import from which, and
any larger strongly connected group of files. `-v` lists every back-up import and inline path with its file and line.

Comments, doc comments and string literals are skipped, so doc links do not count. Paths are
resolved from the file system (`x.rs`, `x/mod.rs`) and the inline `mod x { .. }` blocks.
"""
import os
import re
import sys
from collections import defaultdict

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip(text):
    """Blanks comments, strings and char literals, keeping offsets and newlines."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"\w", text[i - 1 : i] or " "):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i : j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand(tree):
    """`a::{b, c::{self, d}}` -> [[a, b], [a, c], [a, c, d]] (renames and globs kept as names)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    paths = []

    def walk(s, prefix):
        # split s at top-level commas
        parts, depth, cur = [], 0, ""
        for ch in s:
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
        for p in parts:
            if "{" in p:
                head, rest = p.split("{", 1)
                head = [x for x in head.split("::") if x]
                walk(rest[: rest.rfind("}")], prefix + head)
            else:
                segs = [x for x in p.split("::") if x]
                if segs == ["self"]:
                    paths.append(prefix)
                else:
                    paths.append(prefix + segs)

    walk(tree, [])
    return paths


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # module path tuple -> file path
        for dirpath, _, names in os.walk(src):
            for name in names:
                if name.endswith(".rs"):
                    path = os.path.join(dirpath, name)
                    self.files[self.module_of(path)] = path
        self.text = {m: strip(open(p, encoding="utf-8").read()) for m, p in self.files.items()}

    def module_of(self, path):
        rel = os.path.relpath(path, self.src)[:-3].split(os.sep)
        if rel[-1] in ("mod", "lib", "main"):
            rel = rel[:-1]
        return tuple(rel)

    def is_module(self, m):
        return m in self.files

    def reexport(self, m, name):
        """The module a `pub use` in module m takes `name` from, or None."""
        for st in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", self.text.get(m, "")):
            for p in expand(st.group(1)):
                if p and p[-1] == name:
                    target, _ = self.resolve(m, m, p[:-1] + ["*"])
                    return target
        return None

    def resolve(self, file_mod, here, segs):
        """(landing module, item name or None) of path segs written in module `here`."""
        cur = list(here)
        i = 0
        if segs and segs[0] == "crate":
            cur, i = [], 1
        while i < len(segs) and segs[i] in ("super", "self"):
            if segs[i] == "super":
                cur = cur[:-1]
            i += 1
        if i == 0 and segs and not self.is_module(tuple(cur) + (segs[0],)):
            return None, None  # an external crate or a local name
        while i < len(segs) and self.is_module(tuple(cur) + (segs[i],)):
            cur.append(segs[i])
            i += 1
        item = segs[i] if i < len(segs) and segs[i] != "*" else None
        return tuple(cur), item


def scan(crate, root_mod):
    """Per-file statistics and dependency edges of the files under root_mod."""
    stats = {}
    edges = defaultdict(set)
    detail = []
    for m, path in sorted(crate.files.items()):
        if m[: len(root_mod)] != root_mod:
            continue
        text = crate.text[m]
        # inline module stack by offset
        stack, mods_at = [], []
        for tok in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{|\{|\}", text):
            if tok.group(0) == "}":
                if stack:
                    stack.pop()
            else:
                stack.append(tok.group(1))
            mods_at.append((tok.end(), tuple(x for x in stack if x)))

        def here_at(off):
            inner = ()
            for end, mods in mods_at:
                if end > off:
                    break
                inner = mods
            return m + inner

        def climbs(landing, item):
            return (
                landing is not None
                and item is not None
                and len(landing) < len(m)
                and landing == m[: len(landing)]
                and landing[: len(root_mod)] == root_mod
            )

        def target_file(landing, item):
            t = landing
            while t and t not in crate.files:
                t = t[:-1]
            seen = 0
            while item is not None and seen < 8:
                r = crate.reexport(t, item)
                if r is None or r == t:
                    break
                t, seen = r, seen + 1
            return t

        def depends(t, item):
            inside = t[: len(root_mod)] == root_mod
            ancestor = t == m[: len(t)]
            return t != m and inside and (not ancestor or item is not None)

        n_use = n_up = n_inline = 0
        use_spans = []
        for st in re.finditer(r"(\bpub(?:\([^)]*\))?\s+)?\buse\s+([^;]+);", text):
            use_spans.append((st.start(), st.end()))
            if st.group(1):
                continue
            here = here_at(st.start())
            paths = expand(st.group(2))
            internal = [p for p in paths if p and (p[0] in ("crate", "super", "self") or crate.is_module(here + (p[0],)))]
            if not internal:
                continue
            n_use += 1
            up = False
            for p in internal:
                landing, item = crate.resolve(m, here, p)
                if landing is None:
                    continue
                if climbs(landing, item):
                    up = True
                    detail.append((path, text.count("\n", 0, st.start()) + 1, "use", "::".join(p)))
                t = target_file(landing, item)
                if depends(t, item):
                    edges[m].add(t)
            n_up += up
        for ref in re.finditer(r"(?<![\w:])(?:crate|super)(?:::" + IDENT + r")+", text):
            if any(a <= ref.start() < b for a, b in use_spans):
                continue
            here = here_at(ref.start())
            p = ref.group(0).split("::")
            landing, item = crate.resolve(m, here, p)
            if item is None and re.match(r"\s*\(", text[ref.end() :]):
                # `super::linear(..)`: a call takes the function, not the module of that name
                landing, item = crate.resolve(m, here, p[:-1] + ["*"])[0], p[-1]
            if landing is None:
                continue
            if climbs(landing, item):
                n_inline += 1
                detail.append((path, text.count("\n", 0, ref.start()) + 1, "inline", ref.group(0)))
            t = target_file(landing, item)
            if depends(t, item):
                edges[m].add(t)
        stats[m] = (path, n_use, n_up, n_inline)
    return stats, edges, detail


def sccs(nodes, edges):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
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
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def report(root, verbose):
    root = os.path.normpath(root)
    src = root
    while os.path.basename(src) != "src":
        parent = os.path.dirname(src)
        if parent == src:
            sys.exit(f"{root}: not under a src/ folder")
        src = parent
    crate = Crate(src)
    root_mod = crate.module_of(os.path.join(root, "mod.rs")) if root != src else ()
    stats, edges, detail = scan(crate, root_mod)
    folders = defaultdict(lambda: [0, 0, 0, 0])
    for m, (path, n_use, n_up, n_inline) in stats.items():
        row = folders[os.path.relpath(os.path.dirname(path), os.path.dirname(src))]
        row[0] += 1
        row[1] += n_use
        row[2] += n_up
        row[3] += n_inline
    print(f"## {root}\n")
    print("| folder | files | imports | back up | inline |")
    print("|---|---:|---:|---:|---:|")
    total = [0, 0, 0, 0]
    for folder in sorted(folders):
        row = folders[folder]
        total = [a + b for a, b in zip(total, row)]
        print(f"| {folder} | " + " | ".join(map(str, row)) + " |")
    print("| **total** | " + " | ".join(map(str, total)) + " |")
    name = lambda mod: os.path.relpath(crate.files[mod], os.path.dirname(src))
    pairs = sorted(
        {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())}
    )
    print(f"\ntwo-file circles: {len(pairs)}")
    for a, b in pairs:
        print(f"- {name(a)} <-> {name(b)}")
    folder_of = lambda mod: os.path.dirname(name(mod))
    deps = defaultdict(set)
    for a in edges:
        for b in edges[a]:
            if folder_of(a) != folder_of(b):
                deps[folder_of(a)].add(folder_of(b))
    if deps:
        print("\nfolder imports (sideways or down, by file):")
        for folder in sorted(deps):
            print(f"- {folder} -> " + ", ".join(sorted(deps[folder])))
    big = [c for c in sccs(sorted(stats), edges) if len(c) > 2]
    print(f"larger strongly connected groups: {len(big)}")
    for c in big:
        print("- " + ", ".join(sorted(name(x) for x in c)))
    if verbose:
        print("\nclimbs:")
        for path, line, kind, p in sorted(detail):
            print(f"- {os.path.relpath(path, os.path.dirname(src))}:{line} ({kind}) {p}")
    print()


def main():
    args = sys.argv[1:]
    verbose = "-v" in args
    roots = [a for a in args if a != "-v"] or ["src/ops"]
    for r in roots:
        report(r, verbose)


if __name__ == "__main__":
    main()
