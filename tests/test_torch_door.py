"""One door for torch's internals: every private PyTorch name the project uses is reached
through ``ti_core._torch``, whose names are each guarded by a test in
``packages/ti-core/tests/test_torch_apis_eager.py`` or ``test_torch_apis.py``. This test reads
every source file of every package (their syntax trees, nothing is imported) and fails on a
private torch name anywhere else: an attribute or import of ``torch`` (or a name imported from
it) that starts with one underscore, or one of the private attributes of torch objects below,
read off anything but ``self``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parents[1]
DOOR: Final[Path] = ROOT / "packages" / "ti-core" / "src" / "ti_core" / "_torch.py"
TORCH_PRIVATE_ATTRIBUTES: Final[frozenset[str]] = frozenset(
    {
        "_version",
        "_parameters",
        "_buffers",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_always_called",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_call_impl",
        "_wrapped_call_impl",
        "_compiled_call_impl",
        "_execution_engine",
        "_local_tensor",
        "_foreach_norm",
        "_current_graph_task_id",
        "_orig_mod",
    }
)
"""Private attributes of torch's objects (modules, tensors, the autograd engine) that a file
could read without naming ``torch`` on the same line."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_aliases(tree: ast.Module) -> set[str]:
    """The local names bound to torch or to something imported from it."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    aliases.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            aliases.update(alias.asname or alias.name for alias in node.names)
    return aliases


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(path: Path) -> list[str]:
    """Each private torch name ``path`` uses, as ``file:line: what``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    aliases = _torch_aliases(tree)
    found = []

    def note(node: ast.AST, what: str) -> None:
        found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = (node.module or "").split(".")
            names = [alias.name for alias in node.names]
            if any(_private(p) for p in parts) or any(_private(n) for n in names):
                note(node, f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch.") and any(
                    _private(p) for p in alias.name.split(".")
                ):
                    note(node, f"import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            if root in aliases:
                note(node, f"{ast.unparse(node)} (a private torch name)")
            elif node.attr in TORCH_PRIVATE_ATTRIBUTES and root not in ("self", "cls"):
                note(node, f"{ast.unparse(node)} (a private attribute of a torch object)")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in TORCH_PRIVATE_ATTRIBUTES
        ):
            note(node, f"{node.value!r} (a private torch attribute, by name)")
    return found


def test_private_torch_names_are_used_only_through_the_door() -> None:
    sources = sorted((ROOT / "packages").glob("*/src/**/*.py"))
    assert DOOR in sources
    found = [use for path in sources if path != DOOR for use in private_uses(path)]
    assert found == [], (
        "private PyTorch names outside ti_core/_torch.py (add them there, each with a guard "
        "test in packages/ti-core/tests/test_torch_apis_eager.py or test_torch_apis.py):\n"
        + "\n".join(found)
    )


def test_the_scan_finds_each_kind_of_use(tmp_path: Path) -> None:
    """The scanner itself, on a file holding one use of each kind it must catch."""
    sample = ROOT / "packages" / "_scan_sample.py"
    sample.write_text(
        "import torch\n"
        "import torch._dynamo\n"
        "from torch import nn\n"
        "from torch._C import _get_tracing_state\n"
        "from torch.utils import _pytree\n"
        "a = torch._C._current_graph_task_id()\n"
        "b = nn.Module._call_impl\n"
        "def f(t, m):\n"
        "    return t._version, m._parameters, m.__dict__.get('_call_impl'), self_ok(t)\n"
        "class C:\n"
        "    def g(self):\n"
        "        return self._parameters, self._version, torch.__version__\n",
        encoding="utf-8",
    )
    try:
        found = private_uses(sample)
    finally:
        sample.unlink()
    lines = sorted(int(use.split(":")[1]) for use in found)
    assert lines == [2, 4, 5, 6, 6, 7, 9, 9, 9], found
