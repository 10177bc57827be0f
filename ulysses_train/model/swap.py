"""Changing what a module computes so that `print(model)` shows it: swap its class for a named subclass."""
from __future__ import annotations

_SWAPPED: dict = {}


def swap_class(module, prefix: str, **attributes) -> None:
    """Give `module` the subclass `prefix + ClassName` of its class, with `attributes` (methods) replaced.

    The module keeps its parameters, buffers and hooks (ZeRO-3 keeps gathering its weights around each call)
    and `isinstance` checks against the stock class still hold. One subclass per (class, prefix), shared by all
    modules of that class; `stock_class(module)` is the class it had before."""
    base = type(module)
    cls = _SWAPPED.get((base, prefix))
    if cls is None:
        cls = type(prefix + base.__name__, (base,), {"__module__": base.__module__, "stock_class": base,
                                                    **attributes})
        _SWAPPED[(base, prefix)] = cls
    module.__class__ = cls


def stock_class(module) -> type:
    """The class `module` had before `swap_class`."""
    return getattr(type(module), "stock_class", type(module))
