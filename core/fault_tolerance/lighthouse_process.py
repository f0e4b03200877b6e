"""A torchft lighthouse started without importing torch: ``python lighthouse_process.py
--bind HOST:PORT --min_replicas N ...`` (the options of ``torchft_lighthouse``).

``torchft_lighthouse`` imports torchft's Python package, and with it torch (about 2 s of
CPU), only to call the lighthouse in torchft's compiled extension. This script loads that
extension file alone. The lighthouse reads the process's own command line, so this must run
as a script file (``python -c`` or ``-m`` would hand it their own flags).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def extension_file() -> Path | None:
    """torchft's compiled extension (``torchft/_torchft*.so``) without importing torchft;
    None when torchft is not installed or has no such file."""
    spec = importlib.util.find_spec("torchft")
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = Path(folder) / f"_torchft{suffix}"
            if candidate.exists():
                return candidate
    return None


def main() -> int:
    path = extension_file()
    if path is None:
        print(
            "lighthouse_process.py: torchft's extension (_torchft) was not found", file=sys.stderr
        )
        return 2
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
    spec = importlib.util.spec_from_loader("torchft._torchft", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return int(module.lighthouse_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
