"""Count import cycles and function-level project imports in a source tree, with the static import graph of
tests/test_structure.py (run from the tree's root, with that test file: python benchmarks/import_graph.py LABEL)."""
import sys

sys.path.insert(0, "tests")
import test_structure as t  # noqa: E402

cycles, late = t.find_cycles(t._graph()), t.late_imports()
print(f"tree: {sys.argv[1]}")
print(f"modules: {len(t.MODULES)}")
print(f"back edges closing an import cycle (depth-first): {len(cycles)}")
for c in cycles:
    print("  cycle:", c)
print(f"function-level imports of project modules outside cli.py: {len(late)}")
for line in late:
    print("  late:", line)
