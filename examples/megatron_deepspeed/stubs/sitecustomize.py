"""Stub for Megatron-DeepSpeed at 4efb479 on DeepSpeed 0.19: ``megatron/training.py`` imports
``deepspeed.compression.compress`` (init_compression, redundancy_clean), which DeepSpeed 0.19 no longer ships. They are
called only with DeepSpeed's compression_training config, which these runs do not use: the stub raises if called."""
import importlib.abc
import importlib.machinery
import sys
import types

NAME = "deepspeed.compression.compress"


def _unavailable(*args, **kwargs):
    raise NotImplementedError("deepspeed.compression.compress is not in this DeepSpeed (stub)")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == NAME else None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.init_compression = module.redundancy_clean = _unavailable
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
