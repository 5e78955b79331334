"""Where the kernel tests run impl='triton' (the `device` fixture of conftest.py), kept apart from
conftest so that a test can check the choice for machines this one is not."""


def kernel_device(interpreted: bool, cuda_available: bool) -> str | None:
    """The CPU under Triton's interpreter; the GPU when kernels are compiled and one is present;
    None (the tests skip) when kernels are compiled and there is no GPU."""
    if interpreted:
        return "cpu"
    return "cuda" if cuda_available else None
