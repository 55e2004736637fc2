"""Where the txbox repository is: the tools' one way to reach the examples and contracts.

The benchmarks, the chaos run and the demo drive the example services of ``examples/``
with the contracts of ``contracts/``; both live in a clone of the repository, never in an
installed package (docs/explanation/development.md, "The development tools").
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from framework.errors import ConfigurationError


def _is_clone(path: Path) -> bool:
    return (path / "examples" / "__init__.py").is_file() and (path / "contracts").is_dir()


@functools.cache
def root() -> Path:
    """The clone these tools were installed from (editable, by ``make setup``), else the one around the cwd."""
    here = Path(__file__).resolve().parents[2]  # <clone>/tools/txbox_tools/repository.py
    cwd = Path.cwd().resolve()
    for candidate in (here, cwd, *cwd.parents):
        if _is_clone(candidate):
            return candidate
    raise ConfigurationError(
        "the txbox development tools need a clone of the txbox repository (its examples/ and contracts/); "
        "run them from the clone, where `make setup` installs them"
    )


def contracts() -> Path:
    """The example services' contracts folder."""
    return root() / "contracts"


def import_examples() -> None:
    """Make the ``examples`` package importable (it is a folder of the clone, not an installed package)."""
    path = str(root())
    if path not in sys.path:
        sys.path.insert(0, path)
