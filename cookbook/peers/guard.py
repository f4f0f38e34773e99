"""Import guards: a peer loads only where its package is installed, and is named with its version.

A peer whose package imports its whole serving framework on ``import <package>`` is loaded
through the smallest shim that reaches its kernel module (see docs/peers.md):

* `bare_package` registers a package without running its ``__init__.py``, so that importing one of
  its submodules runs that submodule (and the modules it imports) and nothing else;
* `stub_module` stands in for one framework module that a kernel module imports for a helper the
  kernels never need on their launch path.

Neither touches the peer's kernel sources or its kernel-launch code.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types

NOT_INSTALLED = "not installed"
INSTALL_HINT = 'pip install -e ".[peers]" (SGLang: see docs/peers.md)'


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message says why."""


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(distribution: str) -> str:
    """The installed version of `distribution`; PeerUnavailable("... not installed") without it."""
    version = installed_version(distribution)
    if version is None:
        raise PeerUnavailable(f"{distribution} {NOT_INSTALLED}")
    return version


def is_not_installed(reason: str | None) -> bool:
    """Whether an unavailability reason is a missing package (the bench folds these into one line)."""
    return bool(reason) and reason.endswith(NOT_INSTALLED)


def bare_package(name: str) -> types.ModuleType:
    """Register package `name` without executing its ``__init__.py``: its submodules then import
    as usual, each running only its own imports. A package already imported is left as it is."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise PeerUnavailable(f"{name}: no such package")
    module = importlib.util.module_from_spec(spec)  # __path__ set, __init__ not run
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def stub_module(name: str, **attributes) -> types.ModuleType:
    """A stand-in module `name` holding only `attributes`, unless the real one is already imported."""
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name, f"stand-in for {name} (cookbook.peers shim: only {sorted(attributes)})")
    module.__dict__.update(attributes)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def first_module(candidates) -> types.ModuleType:
    """The first of `candidates` (module names) that imports: a peer moves its kernels between
    releases. PeerUnavailable naming every failure where none does."""
    errors = []
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {type(error).__name__}: {error}")
    raise PeerUnavailable("no kernel module imports (" + "; ".join(errors) + ")")
