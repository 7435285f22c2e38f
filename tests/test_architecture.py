"""The package's import direction (docs/architecture.md): core -> models -> scoring -> rescoring / training ->
service -> cli, nothing imports upward, rescoring and the service never import the training side, and there is
no import cycle; inside rescoring/, the rooms import in one direction too (lattices -> formats, decode -> nbest,
expand -> runs). Imports inside functions count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "smallstate_lm"

# (layer rank, group): a module may import from a lower rank, or from its own group at the same rank.
CORE, MODELS, SCORING, WORK, SERVICE, FRONT = range(6)
LAYERS = {
    "errors": (CORE, "core"), "files": (CORE, "core"), "vocab": (CORE, "core"), "subword": (CORE, "core"),
    "state": (CORE, "core"), "device": (CORE, "core"),
    "models": (MODELS, "models"),
    "checkpoint": (SCORING, "scoring"), "ngram": (SCORING, "scoring"), "scoring": (SCORING, "scoring"),
    "hf": (SCORING, "scoring"),
    "weights": (SCORING, "scoring"), "lms": (SCORING, "scoring"),
    "rescoring": (WORK, "rescoring"),
    "data": (WORK, "training"), "evaluate": (WORK, "training"), "train": (WORK, "training"),
    "distill": (WORK, "training"), "tasks": (WORK, "training"), "train_config": (WORK, "training"),
    "service": (SERVICE, "service"),
    "cli": (FRONT, "front"), "__main__": (FRONT, "front"), "__init__": (FRONT, "front"),
}
# rescoring/'s rooms, as its subpackages' __init__ docstrings say: a room may import from a lower rank or itself.
ROOMS = {"lattices": 0, "formats": 1, "decode": 1, "nbest": 2, "expand": 2, "runs": 3}
TRAINING = {"data", "evaluate", "train", "train_config", "distill", "tasks", "cli", "__main__"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every smallstate_lm module `path` imports, anywhere in the file, as dotted names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("smallstate_lm"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("smallstate_lm"):
                continue
            out.add(mod)
            # `from . import app` names a submodule
            out.update(f"{mod}.{a.name}" for a in node.names if (PKG.parent / f"{mod}.{a.name}".replace(".", "/")).
                       with_suffix(".py").exists())
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    assert key in LAYERS, f"{module}: not placed in a layer of tests/test_architecture.py (and docs/architecture.md)"
    return LAYERS[key]


def test_nothing_imports_upward():
    bad = []
    for mod, deps in _graph().items():
        rank, group = _layer(mod)
        for d in deps:
            r, g = _layer(d)
            if r > rank or (r == rank and g != group):
                bad.append(f"{mod} -> {d}")
    assert not bad, "imports against the layer direction:\n" + "\n".join(sorted(bad))


def test_rescoring_rooms_import_in_one_direction():
    bad, rescoring = [], "smallstate_lm.rescoring"
    for mod, deps in _graph().items():
        if not mod.startswith(rescoring + "."):
            continue
        room = mod.split(".")[2]
        assert room in ROOMS, f"{mod}: rescoring/ holds only the rooms {sorted(ROOMS)} (and a short __init__)"
        for d in deps:
            if d.startswith(rescoring + ".") and (other := d.split(".")[2]) != room and ROOMS[other] >= ROOMS[room]:
                bad.append(f"{mod} -> {d}")
    assert not bad, "imports against the rooms' direction:\n" + "\n".join(sorted(bad))


def test_rescoring_and_the_service_never_import_the_training_side():
    bad = [f"{mod} -> {d}" for mod, deps in _graph().items() if _layer(mod)[1] in ("rescoring", "service", "scoring")
           for d in deps if d.split(".")[1] in TRAINING]
    assert not bad, "\n".join(bad)


def test_the_services_processes_meet_only_in_what_they_share():
    """A front-end never imports the engine's modules, nor the engine a front-end's: what both need (messages,
    board, admission, cost model, settings, ...) lives at the top of service/, and the supervisor imports
    neither (it starts them as processes)."""
    sides = {"frontend": "engine", "engine": "frontend"}
    bad = []
    for mod, deps in _graph().items():
        parts = mod.split(".")
        if parts[:2] != ["smallstate_lm", "service"] or len(parts) < 3:
            continue
        side = parts[2]
        for d in deps:
            dp = d.split(".")
            if dp[:2] != ["smallstate_lm", "service"] or len(dp) < 3:
                continue
            if (side in sides and dp[2] == sides[side]) or (side == "supervisor" and dp[2] in sides):
                bad.append(f"{mod} -> {d}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_graph_is_read():
    graph = _graph()
    assert "smallstate_lm.rescoring.expand.rescorer" in graph["smallstate_lm.cli"] | {
        d for m in graph if m.startswith("smallstate_lm.rescoring") for d in graph[m]}
    assert "smallstate_lm.state" in graph["smallstate_lm.scoring.scorer"]


def test_an_ngram_only_rescore_imports_no_torch(kenlm_model, tmp_path):
    """`rescore` and `tune` of lattices with an n-gram alone never touch a neural LM: importing
    torch (about 2 s), Ray, FastAPI or transformers would be pure start-up cost."""
    import subprocess
    import sys

    lat = PKG.parent / "lattices"
    fsts = [str(p) for p in sorted(lat.glob("*.fst"))[:3]]
    code = ("import sys\nfrom smallstate_lm.cli import main\n"
            "for argv in sys.argv[1:]:\n"
            "    try:\n        main(argv.split('|'))\n    except SystemExit as e:\n        assert not e.code, e.code\n"
            "print(sorted(m for m in ('torch', 'ray', 'fastapi', 'transformers') if m in sys.modules))\n")
    rescore = "|".join(["rescore", *fsts, "--words", str(lat / "words.txt"), "--ngram", str(kenlm_model),
                        "--refs", str(lat / "ref.txt"), "-o", str(tmp_path / "out"), "--quiet"])
    tune = "|".join(["tune", *fsts, "--words", str(lat / "words.txt"), "--ngram", str(kenlm_model),
                     "--refs", str(lat / "ref.txt"), "-o", str(tmp_path / "w.json"), "--quiet"])
    p = subprocess.run([sys.executable, "-c", code, rescore, tune], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout
    assert (tmp_path / "out" / "best.txt").exists() and (tmp_path / "w.json").exists()


def test_sizing_tries_imports_no_torch():
    """The service's front-ends price requests by trie sizes: scoring/trie (and the path choice's costs) must
    not pull torch in; only the scorer and tree attention do."""
    import subprocess
    import sys

    code = ("import sys\nimport smallstate_lm.scoring.trie, smallstate_lm.scoring.paths\n"
            "print('torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr
