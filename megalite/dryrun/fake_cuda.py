"""A fake CUDA device for FakeTensorMode when this torch was built without CUDA.

FakeTensorMode makes tensors on device "cuda" with no GPU behind them, and a CUDA build of
torch runs forward and backward on them with no GPU present. A CPU-only build stops at the
autograd engine: it finds no CUDA device guard and no CUDA accelerator. The shim below, a
20-line C++ library compiled once with the system compiler (cached per torch version), registers
c10's own FakeGuardImpl as the CUDA device guard and CUDA hooks that report one device; it
must be loaded before torch (torch caches its CUDA hooks at import), so `reexec_with_fake_cuda`
restarts the command with it in LD_PRELOAD. No CUDA kernel can run: only fake tensors reach
"cuda", and a real tensor sent there fails as it would without the shim.
"""

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ENV_FLAG = "MEGALITE_FAKE_CUDA_SHIM"

_SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
struct FakeCUDAHooks final : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};

bool register_fake_cuda_guard() {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
    c10::impl::registerDeviceGuard(c10::DeviceType::CUDA,
                                   new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>());
  }
  return true;
}
const bool registered = register_fake_cuda_guard();
}  // namespace

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}
"""


def _torch_dir() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("torch").origin).parent


def shim_path() -> Path:
    """The compiled shim, built on first use under ~/.cache/megalite (or $XDG_CACHE_HOME)."""
    import torch

    # the torch directory too: the shim's rpath points into it, so another environment's build would not load
    key = hashlib.sha256(f"{torch.__version__}{_torch_dir()}{_SOURCE}{sys.version}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megalite"
    path = cache / f"fake_cuda_{key}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / f"fake_cuda_{key}.{os.getpid()}.cpp"  # per process: two first uses may race
    src.write_text(_SOURCE)
    tdir = _torch_dir()
    compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [*compiler.split(), "-O1", "-shared", "-fPIC", "-std=c++17",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
           f"-I{tdir / 'include'}", str(src), f"-L{tdir / 'lib'}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{tdir / 'lib'}", "-o", str(tmp)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        raise RuntimeError("--dry-run on a torch without CUDA needs a C++ compiler to build its fake CUDA "
                           f"device ({' '.join(cmd[:1])} failed: {detail.strip().splitlines()[-1] if detail else ''})")
    finally:
        src.unlink(missing_ok=True)
    os.replace(tmp, path)  # published whole, never half written
    return path


def fake_cuda_ready() -> bool:
    """True when fake tensors on "cuda" can run forward and backward in this process."""
    import torch

    return torch.version.cuda is not None or os.environ.get(ENV_FLAG) == "1"


def reexec_with_fake_cuda(command: list[str]) -> None:
    """Replace this process by `python *command` (["-m", module, ...] or [script, ...]) with the
    shim preloaded (never returns)."""
    path = shim_path()
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (str(path), env.get("LD_PRELOAD", "")) if p)
    env[ENV_FLAG] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *command], env)


def exit_now(status: int) -> None:
    """Flush and leave without interpreter teardown (never returns). With the shim loaded, the
    autograd engine's thread for the fake CUDA device can abort the teardown ("terminate called
    without an active exception", exit -6) after a run that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class CpuStreamsAsCuda:
    """Within this context a CPU-only torch answers FSDP2's stream and device calls on the fake
    CUDA device (torch.cuda.current_device, Stream, Event, current_stream, stream) with
    torch.cpu's no-op stand-ins: FSDP2 orders its all-gathers and reduce-scatters on CUDA
    streams, and on fake tensors there is nothing to order. A CUDA build keeps its own."""

    _NAMES = ("current_device", "set_device", "Stream", "Event", "current_stream", "stream")

    def __enter__(self):
        import torch

        self._saved = None
        if torch.version.cuda is None:
            self._saved = {name: getattr(torch.cuda, name) for name in self._NAMES}
            torch.cuda.current_device = lambda: 0
            torch.cuda.set_device = torch.cpu.set_device
            for name in ("Stream", "Event", "current_stream", "stream"):
                setattr(torch.cuda, name, getattr(torch.cpu, name))
        return self

    def __exit__(self, *exc):
        import torch

        for name, value in (self._saved or {}).items():
            setattr(torch.cuda, name, value)
