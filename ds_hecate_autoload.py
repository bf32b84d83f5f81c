"""Automatic activation: make ``deepspeed`` Hecate-aware in scripts that never import ds_hecate.

The installed ``ds_hecate_autoload.pth`` runs ``import ds_hecate_autoload`` at interpreter start. This module (kept
outside the ``ds_hecate`` package, whose import is heavy) imports nothing but the standard library: it adds an import hook that waits for ``deepspeed`` to be imported and then imports
``ds_hecate`` (which patches ``deepspeed.initialize`` and DeepSpeed's ZeRO config). A process that never imports
deepspeed pays one tiny module import. ``DS_HECATE_AUTOLOAD=0`` switches it off.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV_SWITCH = "DS_HECATE_AUTOLOAD"


class _PatchAfterImport(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        import ds_hecate  # noqa: F401  (patches deepspeed on import)


class _DeepSpeedWatcher(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` with the regular finders and runs ds_hecate's patch once it has executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the regular lookup below from finding us again
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterImport(spec.loader)
        return spec


def install() -> None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return
    if "deepspeed" in sys.modules:
        import ds_hecate  # noqa: F401
        return
    if not any(isinstance(f, _DeepSpeedWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedWatcher())


install()
