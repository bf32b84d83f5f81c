"""Stub: Megatron-DeepSpeed imports torchvision for its vision models only (megatron/data/vit_dataset.py via
megatron/model/vision/knn_monitor.py, reached from megatron/training.py); GPT pretraining never calls it. Any name
imported from torchvision.transforms or .datasets is a class that does nothing."""
import sys
import types


def _placeholder(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None, "__module__": module_name})
    return __getattr__


for _sub in ("transforms", "datasets"):
    _module = types.ModuleType(f"{__name__}.{_sub}")
    _module.__getattr__ = _placeholder(_module.__name__)
    sys.modules[_module.__name__] = _module
    globals()[_sub] = _module
