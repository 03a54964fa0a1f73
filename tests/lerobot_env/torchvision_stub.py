"""A stand-in for torchvision (PyPI's build does not import beside torch 2.13): any name imports, and is a class
that accepts anything. LeRobot's robot client imports torchvision through its policy configs but never calls it."""
import importlib.abc
import importlib.machinery
import sys
import types


class _AnyType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any


class _Any(metaclass=_AnyType):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return _Any()


class _Module(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


__version__ = "0.0.0+stub"
sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Any
