"""A stand-in for torchvision in the SGLang test venv (.venv-sglang), installed by
scripts/install-sglang.sh. Not torchvision: nothing here computes anything.

Why: SGLang's host pools import `sglang.srt.configs`, which imports torchvision at
module level for its vision models' image transforms (`configs/nano_nemotron_vl.py` via
`multimodal/internvl_utils.py`, `configs/deepseek_ocr.py`). The torchvision on PyPI is a
CUDA build; next to the CPU torch 2.13.0 it fails on import ("operator torchvision::nms
does not exist"), and no CPU build of it is installable from PyPI. The storage layer
the tests drive never calls torchvision.

How: any `torchvision.X.Y` imports; any name read from it is a placeholder (so module
level code such as `InterpolationMode.BICUBIC` as a default argument works), and calling
a placeholder raises. transformers sees torchvision as present and imports the names it
guards behind it, which land here the same way.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

__version__ = "0.28.0"  # the release paired with torch 2.13, for version checks that read it


class _Absent:
    """A name torchvision would have; raises when used as a function or class."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is a stand-in in this venv (scripts/sglang/torchvision)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


def _getattr_for(prefix: str) -> Any:
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{prefix}.{name}")

    return __getattr__


__getattr__ = _getattr_for("torchvision")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        module.__getattr__ = _getattr_for(module.__name__)
        module.__path__ = []


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


sys.meta_path.append(_Finder())
