"""The patch list is data: every entry resolves, installs once, reverts, and versions are checked."""

from __future__ import annotations

import importlib
import sys

import pytest

from vllm_sampling_mask import patching
from vllm_sampling_mask.patches import PATCHES
from vllm_sampling_mask.patching import (
    Patch,
    UnsupportedVllmVersionError,
    apply_patches,
    check_vllm_version,
    revert_patches,
)


def test_targets_are_unique_and_documented() -> None:
    targets = [p.target for p in PATCHES]
    assert len(targets) == len(set(targets))
    for patch in PATCHES:
        assert patch.module == "vllm" or patch.module.startswith("vllm."), patch.target
        assert patch.why and patch.process in {"frontend", "engine-core", "worker"}, patch.target


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target)
def test_every_target_and_wrapper_resolves(patch: Patch) -> None:
    module = importlib.import_module(patch.module)
    owner, name = patching.resolve_owner(patch, module)
    if patch.adds:
        assert hasattr(owner, name)  # the plugin (loaded with vLLM) added it
    else:
        assert hasattr(owner, name), patch.target
    make_module, _, make_name = patch.make.partition(":")
    assert callable(getattr(importlib.import_module(make_module), make_name))


def test_all_patches_are_installed_in_a_vllm_process() -> None:
    import vllm.engine.arg_utils  # noqa: F401  (vLLM's platform plugin loading installs them)

    for patch in PATCHES:
        importlib.import_module(patch.module)
    assert set(patching.applied_targets()) >= {p.target for p in PATCHES}


def test_apply_is_idempotent_and_revert_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    import types
    import sys

    module = types.ModuleType("vllm_fake_target")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm_fake_target", None)

    class Thing:
        def method(self) -> str:
            return "original"

    module.Thing = Thing
    monkeypatch.setitem(sys.modules, "vllm_fake_target", module)
    monkeypatch.setitem(sys.modules, "vllm_fake_wrappers", types.ModuleType("vllm_fake_wrappers"))
    calls = []

    def wrap(original):
        calls.append(original)
        return lambda self: "wrapped " + original(self)

    sys.modules["vllm_fake_wrappers"].wrap = wrap
    patch = Patch(target="vllm_fake_target:Thing.method", make="vllm_fake_wrappers:wrap",
                  why="test", process="frontend")
    apply_patches([patch])
    apply_patches([patch])
    assert Thing().method() == "wrapped original"
    assert len(calls) == 1
    revert_patches([patch.target])
    assert Thing().method() == "original"


def test_a_scoped_patch_is_bound_only_inside_its_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    module = types.ModuleType("vllm_fake_scoped")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm_fake_scoped", None)
    module.Output = tuple
    monkeypatch.setitem(sys.modules, "vllm_fake_scoped", module)
    wrappers = types.ModuleType("vllm_fake_scoped_wrappers")
    wrappers.replace = lambda original: list
    monkeypatch.setitem(sys.modules, "vllm_fake_scoped_wrappers", wrappers)
    patch = Patch(target="vllm_fake_scoped:Output", make="vllm_fake_scoped_wrappers:replace",
                  why="test", process="engine-core", scoped=True)
    apply_patches([patch])
    try:
        assert module.Output is tuple and patching.original_of(patch.target) is tuple
        with patching.scoped_patch(patch.target):
            assert module.Output is list
            with patching.scoped_patch(patch.target):  # nested: the outer block still sees it
                assert module.Output is list
            assert module.Output is list
        assert module.Output is tuple
        # Overlapping blocks of two threads (in-process engines): the binding holds until the
        # last one leaves, whichever entered first.
        first, second = patching.scoped_patch(patch.target), patching.scoped_patch(patch.target)
        assert first is second  # made once, when installed: a step opens it without building it
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert module.Output is list
        second.__exit__(None, None, None)
        assert module.Output is tuple
        with pytest.raises(RuntimeError), patching.scoped_patch(patch.target):
            raise RuntimeError("the binding is restored on errors too")
        assert module.Output is tuple
    finally:
        revert_patches([patch.target])
    with pytest.raises(KeyError):
        with patching.scoped_patch(patch.target):
            pass


def test_an_instance_class_changes_only_its_objects_and_frees_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import sys
    import types
    import weakref

    class State:
        def describe(self) -> str:
            return "vllm"

    module = types.ModuleType("vllm_fake_instance")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm_fake_instance", None)
    module.State = State
    monkeypatch.setitem(sys.modules, "vllm_fake_instance", module)
    wrappers = types.ModuleType("vllm_fake_instance_wrappers")
    wrappers.wrap = lambda original: lambda self: "masked " + original(self)
    monkeypatch.setitem(sys.modules, "vllm_fake_instance_wrappers", wrappers)
    patch = Patch(target="vllm_fake_instance:State.describe", make="vllm_fake_instance_wrappers:wrap",
                  why="test", process="frontend", scoped=True)
    apply_patches([patch])
    try:
        masked_class = patching.instance_class(patch.target, State)
        assert patching.instance_class(patch.target, State) is masked_class  # one per class
        assert patching.instance_class(patch.target, masked_class) is masked_class  # no sub-sub
        plain, masked = State(), masked_class()
        assert (plain.describe(), masked.describe()) == ("vllm", "masked vllm")
        assert type(plain) is State and masked_class.__mro__[1] is State
        assert isinstance(masked, State) and State.describe(masked) == "vllm"
        assert masked_class.__name__ == State.__name__
        gc.disable()  # freed by reference counting alone: the subclass made no cycle
        try:
            ref = weakref.ref(masked)
            del masked
            assert ref() is None
        finally:
            gc.enable()
    finally:
        revert_patches([patch.target])


def test_reverting_the_real_list_restores_vllm_and_reapplies() -> None:
    for patch in PATCHES:
        importlib.import_module(patch.module)
    current = {}
    for patch in PATCHES:
        owner, name = patching.resolve_owner(patch, importlib.import_module(patch.module))
        current[patch.target] = (owner, name, patching.original_of(patch.target))
    revert_patches([p.target for p in PATCHES])
    try:
        for target, (owner, name, original) in current.items():
            if original is patching._MISSING:
                assert not hasattr(owner, name), target
                assert f"{owner.__name__}.{name}" not in sys.modules, target
            else:
                assert patching._raw_attr(owner, name) is original, target
    finally:
        apply_patches(PATCHES)
    assert set(patching.applied_targets()) >= set(current)


def test_deferred_patch_applies_on_import(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "vllm_fake_later.py").write_text("def f():\n    return 1\n")
    (tmp_path / "vllm_fake_later_wrap.py").write_text(
        "def wrap(original):\n    return lambda: original() + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patch = Patch(target="vllm_fake_later:f", make="vllm_fake_later_wrap:wrap", why="test",
                  process="frontend")
    apply_patches([patch])
    try:
        import vllm_fake_later

        assert vllm_fake_later.f() == 2
    finally:
        revert_patches([patch.target])


def test_new_module_installs_while_its_package_is_still_executing(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As the platform plugin does during `import vllm`: the patch list is applied from inside
    # the package's __init__, and `from package.new import X` must work right after.
    package = tmp_path / "vllm_fake_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from vllm_sampling_mask.patching import Patch, apply_patches\n"
        "apply_patches([Patch(target='vllm_fake_pkg:extra', make='vllm_fake_pkg_make:make',\n"
        "                     why='test', process='frontend', adds=True, new_module=True)])\n")
    (tmp_path / "vllm_fake_pkg_make.py").write_text(
        "import types\n"
        "def make(original):\n"
        "    module = types.ModuleType('vllm_fake_pkg.extra')\n"
        "    module.VALUE = original\n"
        "    return module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        from vllm_fake_pkg.extra import VALUE

        import vllm_fake_pkg

        assert VALUE is None and sys.modules["vllm_fake_pkg.extra"] is vllm_fake_pkg.extra
    finally:
        revert_patches(["vllm_fake_pkg:extra"])
        sys.modules.pop("vllm_fake_pkg", None)
    assert "vllm_fake_pkg.extra" not in sys.modules


def test_new_module_is_refused_where_the_package_ships_one(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "vllm_fake_native"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "extra.py").write_text("")  # a vLLM that has the module natively
    monkeypatch.syspath_prepend(str(tmp_path))
    import vllm_fake_native  # noqa: F401

    patch = Patch(target="vllm_fake_native:extra", make="types:ModuleType", why="test",
                  process="frontend", adds=True, new_module=True)
    try:
        with pytest.raises(RuntimeError, match="already exists"):
            apply_patches([patch])
    finally:
        revert_patches([patch.target])
        sys.modules.pop("vllm_fake_native", None)


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.26.0+cpu"])
def test_supported_versions(version: str) -> None:
    check_vllm_version(version)


def test_native_versions_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedVllmVersionError, match=r"0\.28\.0.*natively"):
        check_vllm_version("0.28.0")


@pytest.mark.parametrize("version", ["0.25.1", "0.27.0", "dev"])
def test_other_versions_are_refused(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersionError, match=version.replace(".", r"\.")):
        check_vllm_version(version)


def test_another_vllm_warns_once_and_refuses_only_the_switch(
        tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On a vLLM other than 0.26.x (simulated) the plugin entry points raise nothing (vLLM does
    not catch general-plugin errors: every engine would fail), warn once per process and install
    only the version guard: an engine with the switch off is vLLM's, one with it on is refused
    at start by version."""
    import logging

    from vllm.engine.arg_utils import EngineArgs

    from vllm_sampling_mask import plugin
    from vllm_sampling_mask.config import SamplingMaskConfig

    for patch in PATCHES:
        importlib.import_module(patch.module)
    guards = [p.target for p in PATCHES if p.version_guard]
    assert guards == ["vllm.engine.arg_utils:EngineArgs.create_engine_config"]
    revert_patches([p.target for p in PATCHES])
    try:
        monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.28.1")
        monkeypatch.setattr(plugin, "_warned_versions", set())
        with caplog.at_level(logging.WARNING, logger="vllm_sampling_mask"):
            plugin.register_early()
            plugin.register()
            plugin.register()
        warnings = [r.getMessage() for r in caplog.records if "0.28.1" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "natively" in warnings[0]
        ours = {p.target for p in PATCHES}
        assert [t for t in patching.applied_targets() if t in ours] == guards

        common = dict(model=tiny_model_dir, enforce_eager=True, max_model_len=256)
        plain = EngineArgs(**common).create_engine_config()
        assert not SamplingMaskConfig.of(plain).enabled
        with pytest.raises(ValueError, match=r"got vLLM 0\.28\.1.*natively"):
            EngineArgs(**common, logprobs_mode="processed_logprobs",
                       additional_config={"return_sampling_mask": True}).create_engine_config()
    finally:
        revert_patches(guards)
        apply_patches(PATCHES)
    assert set(patching.applied_targets()) >= {p.target for p in PATCHES}


def test_a_version_guard_whose_target_is_missing_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard runs on vLLMs the patches were not written for: a missing target is logged, never
    an error (the other patches still raise)."""
    import sys
    import types

    module = types.ModuleType("vllm_fake_guarded")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm_fake_guarded", None)
    monkeypatch.setitem(sys.modules, "vllm_fake_guarded", module)
    guard = Patch(target="vllm_fake_guarded:Gone.method", make="vllm_fake_guarded:wrap",
                  why="test", process="frontend", version_guard=True)
    apply_patches([guard])
    assert guard.target not in patching.applied_targets()
    with pytest.raises(AttributeError):
        apply_patches([Patch(target="vllm_fake_guarded:Gone.method", make="vllm_fake_guarded:wrap",
                             why="test", process="frontend")])
