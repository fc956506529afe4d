"""The mechanism behind our patches of vLLM symbols (the list itself is in ``patches.py``).

A ``Patch`` names one vLLM attribute (``module:Qualified.name``), every other module-level
binding of the same object that must change with it, and why; all of them were written for the
vLLM series ``SUPPORTED_VLLM_SERIES`` (``check_vllm_version`` refuses any other; on another vLLM
only the ``version_guard`` patches are installed, and a guard whose target is missing is skipped).
``apply_patches`` installs each patch as soon as its module is imported (an import hook defers
patches whose module is not imported yet), exactly once per process: applying again is a
no-op, so every process may call it from any plugin entry point. A *scoped* patch is resolved and
checked the same way but bound only where a mask engine needs it: inside a ``scoped_patch`` block,
or on the objects made from ``instance_class``, so a per-output hot path costs nothing with the
switch off. ``revert_patches`` restores the originals (tests use it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm_sampling_mask")

SUPPORTED_VLLM_SERIES = "0.26"
"""Our patches were written against vLLM 0.26.x sources and are refused on anything else."""

NATIVE_SUPPORT_VERSION = (0, 28)

_MARK = "__vllm_sampling_mask_patch__"


class UnsupportedVllmVersionError(ValueError):
    """Raised when the installed vLLM is not one the patches were written for (a ``ValueError``:
    an engine with the switch on is refused with it at start)."""


def check_vllm_version(version: str) -> None:
    """Raise ``UnsupportedVllmVersionError`` unless ``version`` is a vLLM 0.26.x release."""
    parts = version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor is not None and ".".join(parts[:2]) == SUPPORTED_VLLM_SERIES:
        return
    if major_minor is not None and major_minor >= NATIVE_SUPPORT_VERSION:
        hint = (
            "vLLM >= 0.28 ships sampling masks natively (--return-sampling-mask): "
            "uninstall vllm-sampling-mask and use vLLM's own feature."
        )
    else:
        hint = "Install vLLM 0.26: pip install 'vllm==0.26.0' (the release it is tested with)."
    raise UnsupportedVllmVersionError(
        f"vllm-sampling-mask supports vLLM {SUPPORTED_VLLM_SERIES}.x only, got vLLM {version}. "
        f"{hint}"
    )


@dataclass(frozen=True)
class Patch:
    """One patched vLLM attribute.

    ``target`` is ``"module:attr"`` or ``"module:Class.attr"``. ``make`` (``"module:function"``,
    imported only when the patch is installed) receives the original object and returns its
    replacement (a wrapper that calls the original, or a subclass).
    ``also_bound_in`` lists other modules that did ``from module import attr`` and whose binding
    must be replaced too. ``adds`` marks a new attribute (``make`` then receives ``None``).
    ``new_module`` (with ``adds``) marks a new submodule ``module.attr``: ``make`` returns the
    module object, which is also registered in ``sys.modules`` so that ``import module.attr``
    finds it; it is installed as soon as its parent package is in ``sys.modules``, even while
    the package is still executing (the platform plugin runs during ``import vllm``).
    ``scoped`` keeps vLLM's object bound except inside ``scoped_patch(target)`` or, for a method,
    on the objects made from ``instance_class(target, cls)``. ``version_guard`` patches are the
    only ones installed on a vLLM other than ``SUPPORTED_VLLM_SERIES``: their wrappers refuse the
    switch there by version and otherwise call vLLM's object; a missing target is skipped, not an
    error. ``process`` says where the patch matters (documentation and tests).
    """

    target: str
    make: str
    why: str
    process: str
    also_bound_in: tuple[str, ...] = ()
    adds: bool = False
    new_module: bool = False
    scoped: bool = False
    version_guard: bool = False
    remove_when: str = "vLLM >= 0.28 (native sampling masks)"

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.target.split(":")[1].split("."))

    @property
    def module_name(self) -> str:
        """``module.attr``, the name a ``new_module`` patch is imported by."""
        return ".".join((self.module, *self.path))


@dataclass
class _AppliedPatch:
    patch: Patch
    owner: Any
    name: str
    original: Any
    replacement: Any
    rebound: list[tuple[ModuleType, str]] = field(default_factory=list)
    scope: _ScopedBinding | None = None  # a scoped patch's block, made once (``scoped_patch``)


_MISSING = object()
_applied: dict[str, _AppliedPatch] = {}
_pending: dict[str, list[Patch]] = {}
_instance_classes: dict[tuple[str, type], type] = {}
_scope_depths: dict[str, int] = {}  # scoped_patch blocks open per target, all threads
_lock = threading.RLock()


def resolve_owner(patch: Patch, module: ModuleType) -> tuple[Any, str]:
    """Return ``(object holding the attribute, attribute name)`` for ``patch``."""
    owner: Any = module
    for name in patch.path[:-1]:
        owner = getattr(owner, name)
    return owner, patch.path[-1]


def _raw_attr(owner: Any, name: str) -> Any:
    # Class attributes are read from __dict__ so staticmethod/classmethod wrappers are kept.
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name]
        raise AttributeError(f"{owner.__qualname__} has no attribute {name!r}")
    return getattr(owner, name)


def _resolve(dotted: str) -> Callable[[Any], Any]:
    module_name, _, attr = dotted.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _install(patch: Patch, module: ModuleType) -> None:
    with _lock:
        if patch.target in _applied:
            return
        try:
            owner, name = resolve_owner(patch, module)
            if patch.version_guard:
                _raw_attr(owner, name)
        except AttributeError:
            if not patch.version_guard:
                raise
            # A vLLM the patches were not written for: a guard must never break its import.
            logger.warning("vllm-sampling-mask: %s not found on this vLLM; the switch is not "
                           "refused by version there.", patch.target)
            return
        if patch.adds:
            if hasattr(owner, name) or (patch.new_module and _ships_submodule(module, name)):
                raise RuntimeError(f"{patch.target} already exists: this vLLM is not the one the patch was written for")
            original = _MISSING
        else:
            original = _raw_attr(owner, name)
        if getattr(original, _MARK, None) == patch.target:
            return
        replacement = _resolve(patch.make)(None if original is _MISSING else original)
        try:
            setattr(replacement, _MARK, patch.target)
        except (AttributeError, TypeError):  # e.g. staticmethod objects on old Pythons
            pass
        record = _AppliedPatch(patch, owner, name, original, replacement)
        _applied[patch.target] = record
        if patch.scoped:
            record.scope = _ScopedBinding(patch.target, record)
            return  # swapped in by scoped_patch only
        if patch.new_module:
            sys.modules[patch.module_name] = replacement
        setattr(owner, name, replacement)
        for other in patch.also_bound_in:
            other_module = importlib.import_module(other)
            if getattr(other_module, name, None) is original:
                setattr(other_module, name, replacement)
                record.rebound.append((other_module, name))


def _ships_submodule(package: ModuleType, name: str) -> bool:
    """Whether ``package`` has a submodule ``name`` of its own (on disk, not yet imported)."""
    search_path = getattr(package, "__path__", None)
    if search_path is None:
        return False
    return importlib.machinery.PathFinder.find_spec(f"{package.__name__}.{name}", search_path) is not None


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs pending patches right after their module finishes executing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, fullname: str):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            patches = _pending.pop(self._fullname, [])
        for patch in patches:
            _install(patch, module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tools
        return getattr(self._loader, name)


_finder = _PostImportFinder()


def apply_patches(patches: list[Patch]) -> None:
    """Install every patch now or as soon as its module is imported. Idempotent."""
    with _lock:
        for patch in patches:
            if patch.target in _applied:
                continue
            module = sys.modules.get(patch.module)
            if (module is not None and getattr(module, "__spec__", None) is not None
                    and (patch.new_module or not _is_initializing(module))):
                _install(patch, module)
            elif patch not in _pending.setdefault(patch.module, []):
                _pending[patch.module].append(patch)
        if _pending and _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def _is_initializing(module: ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def applied_targets() -> list[str]:
    """Targets installed in this process, in installation order."""
    return list(_applied)


def original_of(target: str) -> Any:
    """The vLLM object a patch replaced (raises ``KeyError`` if not applied)."""
    return _applied[target].original


def scoped_patch(target: str) -> AbstractContextManager[None]:
    """Bind the replacement of the scoped patch ``target`` for the duration of the block.

    Blocks may nest and overlap across threads (two in-process mask engines): the first to enter
    binds the replacement, the last to leave restores vLLM's object. A module binding is
    process-wide, so code in another thread that reads it meanwhile (a switch-off engine's
    scheduler in the same process) sees the replacement too. Raises ``KeyError`` if ``target``
    is not an installed scoped patch.
    """
    scope = _applied[target].scope
    if scope is None:
        raise KeyError(f"{target} is not a scoped patch")
    return scope


class _ScopedBinding:
    """``scoped_patch``'s block, one per scoped patch, made when the patch is installed and
    reused by every block (it keeps no state of its own): a mask engine's scheduler opens one
    every step, so the step neither builds one nor looks up how."""

    __slots__ = ("target", "record")

    def __init__(self, target: str, record: _AppliedPatch) -> None:
        self.target = target
        self.record = record

    def __enter__(self) -> None:
        with _lock:
            depth = _scope_depths.get(self.target, 0)
            if depth == 0:
                setattr(self.record.owner, self.record.name, self.record.replacement)
            _scope_depths[self.target] = depth + 1

    def __exit__(self, *exc_info: object) -> None:
        with _lock:
            depth = _scope_depths[self.target] - 1
            _scope_depths[self.target] = depth
            if depth == 0:
                setattr(self.record.owner, self.record.name, self.record.original)


def instance_class(target: str, cls: type) -> type:
    """The subclass of ``cls`` (made once per class) that overrides only the method of the
    scoped patch ``target`` with its replacement; ``cls`` keeps vLLM's method.

    Objects are to be made from it (``cls`` itself is returned if it already overrides the
    method), never moved into it: on CPython 3.11-3.12 assigning ``obj.__class__`` moves the
    object's attributes into a dict of its own, through which every later attribute read of
    vLLM's code on it is slower (reading ``obj.__dict__`` does the same). Unlike a bound method
    stored on the instance, the subclass makes no reference cycle, so its objects are still
    freed by reference counting. Raises ``KeyError`` if ``target`` is not an installed scoped
    patch.
    """
    record = _applied[target]
    if not record.patch.scoped:
        raise KeyError(f"{target} is not a scoped patch")
    if cls.__dict__.get(record.name) is record.replacement:
        return cls
    subclass = _instance_classes.get((target, cls))
    if subclass is None:
        namespace = {record.name: record.replacement, "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__}
        subclass = _instance_classes[(target, cls)] = type(cls.__name__, (cls,), namespace)
    return subclass


def take_attribute(obj: object, name: str) -> Any:
    """``obj.name`` (None if unset), left as None on ``obj``: a value handed from one patched
    method to the next on the same object.

    The attribute is reset rather than deleted, and never reached through ``obj.__dict__``:
    vLLM's objects then keep CPython 3.11-3.12's inline attribute layout (see
    ``instance_class``)."""
    value = getattr(obj, name, None)
    if value is not None:
        setattr(obj, name, None)
    return value


def revert_patches(targets: list[str] | None = None) -> None:
    """Restore the originals of ``targets`` (default: every applied patch) and forget pending
    patches (tests)."""
    with _lock:
        for target, record in reversed(list(_applied.items())):
            if targets is not None and target not in targets:
                continue
            module = sys.modules[record.patch.module]
            owner, name = resolve_owner(record.patch, module)
            if record.original is _MISSING:
                delattr(owner, name)
                if record.patch.new_module:
                    sys.modules.pop(record.patch.module_name, None)
            else:
                setattr(owner, name, record.original)
            for other_module, other_name in record.rebound:
                setattr(other_module, other_name, record.original)
            del _applied[target]
            _scope_depths.pop(target, None)
        if targets is None:
            _pending.clear()
            if _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
