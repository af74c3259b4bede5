"""Stand-ins for OpenRLHF's GPU-only imports (DeepSpeed, vLLM, flash-attn), which cannot
install on a CPU machine. They only let OpenRLHF's modules import: calling anything in them
raises, so a test that reached GPU code would fail rather than pass on a stub."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types

GPU_ONLY = ("deepspeed", "vllm", "flash_attn")


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a CPU-test stand-in (GPU-only package)")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in GPU_ONLY:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def installed():
    """The stand-ins, for the packages not really installed, only while importing OpenRLHF:
    left in place they would make other libraries (TRL, transformers) think vLLM is there."""
    import importlib.util

    missing = [n for n in GPU_ONLY if n not in sys.modules and
               importlib.util.find_spec(n) is None]
    finder = _Finder()
    if missing:
        sys.meta_path.append(finder)
    try:
        yield
    finally:
        if missing:
            sys.meta_path.remove(finder)
            for name in [m for m in sys.modules if m.split(".")[0] in missing]:
                del sys.modules[name]
