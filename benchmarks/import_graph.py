"""Count import cycles and function-level project imports in a source tree, with the static import graph of
tests/test_structure.py (run from the tree's root: python benchmarks/import_graph.py LABEL)."""
import sys

sys.path.insert(0, "tests")
import test_structure as t  # noqa: E402

g = t._graph()
state, cycles = {}, []
def visit(m, stack):
    state[m] = "open"
    for n in sorted(g[m]):
        if state.get(n) == "open":
            cycles.append(" -> ".join(stack[stack.index(n):] + [m, n]) if n in stack else f"{m} -> {n}")
        elif n not in state:
            visit(n, stack + [m])
    state[m] = "done"
for m in sorted(g):
    if m not in state:
        visit(m, [])
late = sorted({f"{m} imports {x}" for m in t.MODULES if m != "quantgate.cli" for x, top, _ in t._imports(m) if not top})
print(f"tree: {sys.argv[1]}")
print(f"modules: {len(t.MODULES)}")
print(f"back edges closing an import cycle (depth-first): {len(cycles)}")
for c in cycles: print("  cycle:", c)
print(f"function-level imports of project modules outside cli.py: {len(late)}")
for l in late: print("  late:", l)
