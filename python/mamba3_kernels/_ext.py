"""The compiled front end mamba3_kernels._C (src/torch_ext/binding.cpp), when there is one.

_C does what siso.py's ctypes path does for the functional SISO entry points (same pre-checks and
messages, same outputs, same DLTensors, same library calls) at a fraction of the host cost. It is
optional: without it the ctypes path runs. Which one runs is reported by mamba3_kernels.binding()
("compiled" or "ctypes").

The module is looked up, first match wins:
  1. the environment variable MAMBA3_TORCH_EXT: "0", "off" or "ctypes" disables the compiled
     binding; any other value names the module file (e.g. build/_C.cpython-312-x86_64-linux-gnu.so),
     and failing to load it is an error;
  2. mamba3_kernels/_C<suffix> next to this file (what `pip install .` installs);
  3. _C<suffix> in the directory of the loaded libmamba3.so, then in build*/ of the source checkout
     (newest first), so that PYTHONPATH=python works after a plain CMake build.
libmamba3 is loaded first (through _lib, honouring MAMBA3_LIBRARY), so the module binds to that
same library (the dynamic loader reuses an already loaded libmamba3.so); a module bound to another
copy, or built against another torch version than the running one, is not used (with a warning). In the automatic search (2, 3) a module that fails to load (e.g. built against
another torch) is skipped with a warning.
"""
from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import warnings

from . import _lib

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_OFF = ("0", "off", "ctypes", "false", "no")

_MOD = None
_LOADED = False
_LOCK = threading.Lock()


def _import_from(path: str):
    name = __package__ + "._C"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot load {path!r} as an extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same_library(mod) -> bool:
    a, b = mod.library_path(), _lib.library_path()
    return bool(a) and os.path.realpath(a) == os.path.realpath(b)


def _checked(mod, path):
    import torch
    built = getattr(mod, "torch_version", None)
    if built != torch.__version__:
        # Loading may succeed against another torch, but its C++ ABI need not match: not used.
        warnings.warn(f"mamba3_kernels: {path} was built against torch {built}, this is torch "
                      f"{torch.__version__}; using the ctypes binding (rebuild it with "
                      f"scripts/build_torch_ext.sh)", RuntimeWarning, stacklevel=3)
        return None
    if _same_library(mod):
        return mod
    warnings.warn(f"mamba3_kernels: {path} is bound to {mod.library_path()!r}, not to the loaded "
                  f"{_lib.library_path()!r}; using the ctypes binding", RuntimeWarning,
                  stacklevel=3)
    return None


def candidate_paths() -> list:
    """Where _C is searched when MAMBA3_TORCH_EXT is not set (see the module docstring)."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    paths = [os.path.join(_PKG_DIR, "_C" + s) for s in suffixes]
    dirs = [os.path.dirname(os.path.realpath(_lib.library_path()))]
    root = os.path.dirname(os.path.dirname(_PKG_DIR))
    if os.path.isfile(os.path.join(root, "CMakeLists.txt")):
        builds = [p for s in suffixes for p in glob.glob(os.path.join(root, "build*", "_C" + s))]
        builds.sort(key=lambda p: os.path.getmtime(p), reverse=True)
        dirs.extend(os.path.dirname(p) for p in builds)
    for d in dirs:
        paths.extend(os.path.join(d, "_C" + s) for s in suffixes)
    seen = set()
    return [p for p in paths if not (p in seen or seen.add(p))]


def _find():
    env = os.environ.get("MAMBA3_TORCH_EXT")
    if env is not None and env.strip().lower() in _OFF:
        return None
    importlib.import_module("torch")  # the module needs torch's libraries loaded
    _lib.load()
    if env:
        if not os.path.isfile(env):
            raise OSError(f"MAMBA3_TORCH_EXT={env!r} does not name an existing file")
        return _checked(_import_from(env), env)
    for path in candidate_paths():
        if not os.path.isfile(path):
            continue
        try:
            mod = _import_from(path)
        except ImportError as e:
            warnings.warn(f"mamba3_kernels: cannot load {path} ({e}); using the ctypes binding",
                          RuntimeWarning, stacklevel=3)
            return None
        return _checked(mod, path)
    return None


def load():
    """The compiled module, or None when the ctypes binding is used. Decided once per process."""
    global _MOD, _LOADED
    if _LOADED:
        return _MOD
    with _LOCK:
        if not _LOADED:
            _MOD = _find()
            if _MOD is not None:
                sys.modules.setdefault(__package__ + "._C", _MOD)
            _LOADED = True
    return _MOD


def binding() -> str:
    """"compiled" when the SISO functional entry points run through mamba3_kernels._C, else
    "ctypes"."""
    return "ctypes" if load() is None else "compiled"
