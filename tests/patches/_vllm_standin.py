"""A stand-in for vLLM, run at the top of a patch check (tests/patches/test_vllm_*.py) so that verl's vLLM modules
import on a machine without vLLM. Not a test module: the checks read this file as text.

Every ``vllm`` module becomes an empty module whose names are placeholder classes, and the ``vllm`` distribution
reports the version that verl 0.9.1's ``vllm`` extra pins. The checks call verl's own functions, which only pass values through
vLLM's objects on the paths they test; wherever a vLLM object's behaviour matters, the check replaces it with a
recorder of its own (the CLI parser, the LoRA request, the weight receiver), so nothing here is asserted on.
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types

VLLM_STANDIN_VERSION = "0.24.0"


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name):
        return _Placeholder()


class _StandinModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        if module.__name__ == "vllm":
            module.__version__ = VLLM_STANDIN_VERSION


sys.meta_path.insert(0, _StandinFinder())
_version = importlib.metadata.version
importlib.metadata.version = lambda name: VLLM_STANDIN_VERSION if name == "vllm" else _version(name)
