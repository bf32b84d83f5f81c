"""Automatic activation: make ``deepspeed`` Hecate-aware in scripts that never import ds_hecate.

The installed ``ds_hecate_autoload.pth`` runs ``import ds_hecate_autoload`` at interpreter start (every interpreter,
so also each rank a launcher starts). This module is kept outside the ``ds_hecate`` package, whose import is heavy,
and imports nothing but ``os`` and ``sys``: a process that never imports DeepSpeed pays for this one small module.
``DS_HECATE_AUTOLOAD=0`` switches it off.

How: a finder at the front of ``sys.meta_path`` answers every lookup of ``deepspeed`` with the regular spec whose
loader is wrapped; the wrapper executes DeepSpeed, then imports ``ds_hecate`` (which patches
``deepspeed.initialize`` and DeepSpeed's ZeRO config). The finder stays in place until DeepSpeed has actually been
executed, because libraries look for DeepSpeed long before they import it: transformers and accelerate call
``importlib.util.find_spec("deepspeed")`` (which runs the finders but no loader), ``pkgutil.find_loader`` does the
same, ``importlib.metadata`` reads the distribution without finders. A finder that removed itself on the first
lookup was used up by such a probe and the later ``import deepspeed`` ran unpatched. ``import deepspeed.<sub>``
first imports the package itself, through the same finder.
"""
from __future__ import annotations

import os
import sys

ENV_SWITCH = "DS_HECATE_AUTOLOAD"
_TARGET = "deepspeed"


def _import_ds_hecate() -> None:
    """Import ds_hecate for its patch. A failure must not break DeepSpeed itself: say so and carry on (a config
    with ``zero_optimization.hecate`` is then rejected by DeepSpeed, loudly)."""
    try:
        import ds_hecate  # noqa: F401  (patches deepspeed on import)
    except Exception as exc:  # noqa: BLE001 - reported, DeepSpeed stays usable
        import warnings
        warnings.warn(f"ds_hecate_autoload: `import ds_hecate` failed after `import deepspeed` ({type(exc).__name__}: "
                      f"{exc}); DeepSpeed runs without Hecate. Set {ENV_SWITCH}=0 to skip the attempt.",
                      RuntimeWarning, stacklevel=2)


class _PatchAfterExec:
    """DeepSpeed's own loader, plus ds_hecate's patch once DeepSpeed's package has executed.

    Everything but executing is the wrapped loader's (``get_filename``, ``get_resource_reader``, ... for probes and
    ``importlib.resources``); after executing, the module's ``__loader__`` and ``__spec__.loader`` are DeepSpeed's
    own loader again, so nothing of this hook stays visible.
    """

    def __init__(self, loader, watcher: "_DeepSpeedWatcher") -> None:
        self._loader = loader
        self._watcher = watcher

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_loader", "_watcher"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)  # raises: the watcher stays, a later import tries again
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._watcher.remove()
        _import_ds_hecate()


class _DeepSpeedWatcher:
    """A ``sys.meta_path`` finder for ``deepspeed`` alone: the spec the other finders give, loader wrapped.

    Not an ``importlib.abc.MetaPathFinder`` subclass: ``importlib.abc`` would be the hook's heaviest import, and
    the import system needs nothing but ``find_spec``.
    """

    def __init__(self) -> None:
        self._searching = set()  # thread ids inside find_spec: a finder asked again from within is skipped

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        import _thread
        me = _thread.get_ident()
        if me in self._searching:
            return None
        self._searching.add(me)
        try:
            spec = self._regular_spec(fullname, path, target)
        finally:
            self._searching.discard(me)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchAfterExec(spec.loader, self)
        return spec

    def _regular_spec(self, fullname, path, target):
        """What the import system would find without this watcher: the other finders, in order."""
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, _DeepSpeedWatcher):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Watch for DeepSpeed (once per interpreter), or patch at once if it was imported before this ran."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return
    if _TARGET in sys.modules:
        _import_ds_hecate()
        return
    if not any(isinstance(f, _DeepSpeedWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedWatcher())


install()
