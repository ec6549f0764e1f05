"""Fixtures shared by the GPU test modules (each opts in with pytestmark = usefixtures(...))."""
import pytest


@pytest.fixture(scope="module")
def cuda_backend():
    """The loaded library must have the CUDA backend (a GPU module never tests a CPU build)."""
    import mamba3_kernels
    assert mamba3_kernels.has_cuda(), (
        f"{mamba3_kernels.library_path()} was built without the CUDA backend")


@pytest.fixture(scope="module")
def fp32_reference_matmuls():
    """The float32 references must be float32 computations: no TF32 in their matmuls."""
    import torch
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
