"""A package's names imported when first used (PEP 562), so that importing a torch-free part
of it does not load torch (engine and kvtransfer: the router and the workers' network side)."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: ``exports`` maps each name to the module
    that defines it."""
    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
