"""mamba3_kernels: Mamba-3 sequence-mixing kernels (CPU and CUDA backends) for PyTorch.

    from mamba3_kernels import siso, mimo
    dq, dk, dq_bias, dk_bias, dangles, dscale, dgamma = siso.compute_dqktheta(...)
    ddt, dtrap, d_issm, d_k, d_v = siso.compute_ddt_dtrap_dinput_states(...)
    states, qk_dot, dmimo_o, dmimo_z, dz = mimo.mamba3_mimo_bwd_fwd(...)
    grads = mimo.mamba3_mimo_bwd_bwd(...)   # dict: DQ, DK, DV, ..., DD

Install: `pip install --no-build-isolation .` in the repository (builds the CMake project with
scikit-build-core and puts libmamba3.so into this package; CUDA backend by default, CPU only with
`-Ccmake.define.MAMBA3_CUDA=OFF` or MAMBA3_CUDA=OFF in the environment). From a source checkout
without installing: build with CMake and use PYTHONPATH=python (the library is then found in
build*/ of the checkout) or point MAMBA3_LIBRARY at libmamba3.so.

The SISO operators call the library through the compiled extension mamba3_kernels._C when it is
built (CMake builds it when its Python has torch; scripts/build_torch_ext.sh builds it alone), else
through ctypes: binding() says which; MAMBA3_TORCH_EXT names the module or, set to 0, forces
ctypes (see _ext.py). Both give identical results.

The library is loaded on first use (see _lib.py for the search order). `siso` and `mimo` (which
need torch; mimo's functions are also reachable from here) are imported on first access, so the
torch-free parts (has_cuda(), library_version(), the ctypes layer) work without torch.
"""
from __future__ import annotations

import importlib

from ._lib import library_path

__version__ = "0.1.0"  # keep equal to project(... VERSION) in CMakeLists.txt

__all__ = ["siso", "mimo", "mamba3_mimo_bwd_fwd", "mamba3_mimo_bwd_fwd_out",
           "mamba3_mimo_bwd_bwd", "mamba3_mimo_bwd_combined", "has_cuda",
           "library_version", "library_path", "binding", "__version__"]


def has_cuda() -> bool:
    """True if the loaded libmamba3 was built with its CUDA backend."""
    from ._lib import load
    return bool(load().has_cuda())


def library_version() -> str:
    """Version string compiled into the loaded libmamba3."""
    from ._lib import load
    return load().version().decode()


def binding() -> str:
    """Which binding the SISO functional operators use: "compiled" (the torch extension
    mamba3_kernels._C, built by CMake when torch is found; see _ext.py for where it is looked up
    and MAMBA3_TORCH_EXT) or "ctypes" (the pure-Python path). Needs torch; loads the library."""
    from ._ext import binding as _binding
    return _binding()


def __getattr__(name):
    if name in ("siso", "mimo"):
        return importlib.import_module("." + name, __name__)
    if name in ("mamba3_mimo_bwd_fwd", "mamba3_mimo_bwd_fwd_out", "mamba3_mimo_bwd_bwd",
                "mamba3_mimo_bwd_combined"):
        return getattr(importlib.import_module(".mimo", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
