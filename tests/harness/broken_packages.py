"""Broken installs of optional packages: the ways a broken package fails on import, and a package written
into a folder a test puts first on the path."""

from __future__ import annotations

from pathlib import Path

# How broken installs fail on import: the exception each raises, and the code that raises it.
BREAKAGES = {
    "ImportError": "raise ImportError('/site-packages/pkg/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')",
    "AttributeError": "import sys\nsys.int1  # a dtype this interpreter lacks, as torchao looks up torch.int1",
    "OSError": "raise OSError('libmpi.so.40: cannot open shared object file: No such file or directory')",
    "RuntimeError": "raise RuntimeError('The NVIDIA driver on your system is too old (found version 11040).')",
    "ModuleNotFoundError": "import a_dependency_that_is_gone",
}


def write_package(root: Path, dotted: str, body: str = "") -> Path:
    """`dotted` as a package under `root` whose innermost `__init__.py` is `body`; returns `root`."""
    folder = root.joinpath(*dotted.split("."))
    folder.mkdir(parents=True, exist_ok=True)
    for depth in range(1, len(dotted.split(".")) + 1):
        init = root.joinpath(*dotted.split(".")[:depth], "__init__.py")
        if not init.exists():
            init.write_text("")
    (folder / "__init__.py").write_text(body + "\n")
    return root
