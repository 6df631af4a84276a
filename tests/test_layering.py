"""The import arrows point one way: entry points -> engine -> core/worker/features -> models ->
kernels. Read from the source (ast), so a new upward import fails here, not in a review."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("pagedjax", "models", "pallas_kernels")  # the source folders
# the folders beside pagedjax/ install under it (a user's own `models` package never collides)
INSTALLED_AS = {"models": "pagedjax.models", "pallas_kernels": "pagedjax.pallas_kernels"}
# what each package may import directly, besides itself; a package may also import whatever
# those may (transitively)
MAY_IMPORT = {
    "pallas_kernels": [],
    "pagedjax.platforms": ["pallas_kernels"],  # one object per backend: every "which backend" answer
    "models": ["pallas_kernels", "pagedjax.platforms"],
    "pagedjax.sampling_params": [],
    "pagedjax.outputs": [],
    "pagedjax.core": ["pagedjax.sampling_params", "pagedjax.outputs"],
    "pagedjax.sample": ["pagedjax.sampling_params", "pallas_kernels", "pagedjax.platforms"],
    "pagedjax.structured_output": ["pagedjax.core", "pagedjax.sample"],
    "pagedjax.parallel": ["pagedjax.core", "models"],
    "pagedjax.spec_decode": ["pagedjax.core", "pagedjax.sample", "models"],
    "pagedjax.lora": ["pagedjax.core", "models"],
    "pagedjax.pooling": ["pagedjax.core"],
    "pagedjax.worker": ["pagedjax.core", "pagedjax.sample", "pagedjax.parallel", "models"],
    "pagedjax.config": ["models", "pagedjax.spec_decode"],
    "pagedjax.engine": ["pagedjax.config", "pagedjax.worker", "pagedjax.spec_decode", "pagedjax.structured_output",
                        "pagedjax.lora", "pagedjax.pooling"],
    "pagedjax.compare": ["pagedjax.engine"],
    "pagedjax.entrypoints": ["pagedjax.engine", "pagedjax.compare"],
    "pagedjax.integrations": ["pagedjax.entrypoints"],  # adapters for other libraries (Tunix)
    "pagedjax._notices": [],  # logging filters only
    "pagedjax.__init__": ["pagedjax.entrypoints", "pagedjax.lora", "pagedjax.pooling", "pagedjax._notices"],
}


def unit(module: str) -> str:
    """The package (or top-level module) of pagedjax a module belongs to (models and
    pallas_kernels by their folder names)."""
    for folder, name in INSTALLED_AS.items():
        if module == name or module.startswith(name + "."):
            return folder
    parts = module.split(".")
    return parts[0] if parts[0] != "pagedjax" else ".".join(parts[:2]) if len(parts) > 1 else "pagedjax.__init__"


def closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for dep in MAY_IMPORT[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def sources():
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join((INSTALLED_AS.get(parts[0], parts[0]),) + parts[1:]), path


def test_every_package_is_placed():
    units = {unit(m) for m, _ in sources()}
    assert units <= set(MAY_IMPORT), f"packages missing from MAY_IMPORT: {sorted(units - set(MAY_IMPORT))}"


def test_imports_point_down():
    wrong = []
    for module, path in sources():
        me = unit(module)
        allowed = closure(me) | {me}
        for target in imports(path):
            if target.split(".")[0] in ("models", "pallas_kernels"):
                wrong.append(f"{path.relative_to(ROOT)}: imports {target} (import pagedjax.{target})")
            elif target.split(".")[0] == "pagedjax" and unit(target) not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}: {me} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_core_is_host_only():
    """The block pool, scheduler and requests are plain Python/numpy: testable with no model."""
    heavy = [f"{path.relative_to(ROOT)}: {t}" for m, path in sources() if unit(m) == "pagedjax.core"
             for t in imports(path) if t.split(".")[0] in ("jax", "jaxlib", "flax")]
    assert not heavy
