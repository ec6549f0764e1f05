"""Loading libmamba3.so with ctypes and turning its status codes into Python exceptions.

The library is looked up, first match wins:
  1. the file named by the environment variable MAMBA3_LIBRARY (an error if it does not exist);
  2. libmamba3.so next to this file (what `pip install .` installs);
  3. build*/libmamba3.so of the source checkout this package sits in (python/mamba3_kernels ->
     repository root), newest first, so that PYTHONPATH=python works after a plain CMake build.

Loading is lazy (on first use), so `import mamba3_kernels` works without the library and the error
names every place that was searched. The ctypes function objects are created once with their
argtypes/restype declared; callers keep references to them to avoid attribute look-ups per call.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading

# mamba3_status (include/mamba3/mamba3.h)
OK = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_UNSUPPORTED = 2
ERROR_CUDA = 3
ERROR_INTERNAL = 4
_STATUS_NAMES = {
    ERROR_INVALID_ARGUMENT: "MAMBA3_ERROR_INVALID_ARGUMENT",
    ERROR_UNSUPPORTED: "MAMBA3_ERROR_UNSUPPORTED",
    ERROR_CUDA: "MAMBA3_ERROR_CUDA",
    ERROR_INTERNAL: "MAMBA3_ERROR_INTERNAL",
}

_LIB_NAME = "libmamba3.so"
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def candidate_paths() -> list:
    """Where the library is searched, in order (MAMBA3_LIBRARY is handled by load())."""
    paths = [os.path.join(_PKG_DIR, _LIB_NAME)]
    root = os.path.dirname(os.path.dirname(_PKG_DIR))
    if os.path.isfile(os.path.join(root, "CMakeLists.txt")):
        builds = glob.glob(os.path.join(root, "build*", _LIB_NAME))
        builds.sort(key=lambda p: os.path.getmtime(p), reverse=True)
        paths.extend(builds)
    return paths


class _Functions:
    """The library and its ctypes function objects, argtypes declared once."""

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        self.lib = lib
        vp = ctypes.c_void_p

        self.last_error = lib.mamba3_last_error
        self.last_error.argtypes = []
        self.last_error.restype = ctypes.c_char_p

        self.version = lib.mamba3_version
        self.version.argtypes = []
        self.version.restype = ctypes.c_char_p

        self.has_cuda = lib.mamba3_has_cuda
        self.has_cuda.argtypes = []
        self.has_cuda.restype = ctypes.c_int

        # (q, scale, chunk_size, cu_seqlens, size_t* workspace_bytes)
        self.dqktheta_workspace_size = lib.mamba3_compute_dqktheta_workspace_size
        self.dqktheta_workspace_size.argtypes = [vp, vp, ctypes.c_int64, vp,
                                                 ctypes.POINTER(ctypes.c_size_t)]
        self.dqktheta_workspace_size.restype = ctypes.c_int

        # 10 inputs, d_ok_state, chunk_size, cu_seqlens, 7 outputs, workspace, bytes, stream
        self.dqktheta = lib.mamba3_compute_dqktheta
        self.dqktheta.argtypes = ([vp] * 11 + [ctypes.c_int64, vp] + [vp] * 7
                                  + [vp, ctypes.c_size_t, vp])
        self.dqktheta.restype = ctypes.c_int

        # 4 inputs, 3 state inputs, cu_seqlens, 5 outputs, stream
        self.ddt_dtrap = lib.mamba3_compute_ddt_dtrap_dinput_states
        self.ddt_dtrap.argtypes = [vp] * 14
        self.ddt_dtrap.restype = ctypes.c_int


_FNS = None
_LOCK = threading.Lock()


def load() -> _Functions:
    """Loads the library once and returns its function table."""
    global _FNS
    if _FNS is not None:
        return _FNS
    with _LOCK:
        if _FNS is not None:
            return _FNS
        env = os.environ.get("MAMBA3_LIBRARY")
        if env:
            if not os.path.isfile(env):
                raise OSError(f"MAMBA3_LIBRARY={env!r} does not name an existing file")
            _FNS = _Functions(env)
            return _FNS
        tried = candidate_paths()
        for path in tried:
            if os.path.isfile(path):
                _FNS = _Functions(path)
                return _FNS
        raise OSError(
            f"{_LIB_NAME} not found; set MAMBA3_LIBRARY, install the package "
            f"(pip install --no-build-isolation .) or build it with CMake. Searched: "
            + ", ".join(tried))


def library_path() -> str:
    return load().path


def raise_status(status: int) -> None:
    """Raises the exception of a non-zero mamba3_status with mamba3_last_error()'s message:
    ValueError for MAMBA3_ERROR_INVALID_ARGUMENT (the message names the argument), RuntimeError
    for every other failure (prefixed with the status name)."""
    msg = load().last_error().decode("utf-8", "replace")
    if status == ERROR_INVALID_ARGUMENT:
        raise ValueError(msg)
    raise RuntimeError(f"{_STATUS_NAMES.get(status, f'status {status}')}: {msg}")
