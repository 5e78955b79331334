"""Reading Megatron-LM's pickled files (model_optim_rng.pt, a torch_dist checkpoint's common.pt
and .metadata) without running code from them.

model_optim_rng.pt is a torch.save of a dict holding tensors, the run's argparse.Namespace
('args'), the RNG states (Python's random tuple, numpy's MT19937 state array, torch byte tensors)
and, in the Namespace, a few Megatron enums (AttnBackend, CudaGraphModule, ...). It is read with
torch.load(weights_only=True) and an allowlist:
  - argparse.Namespace, io.BytesIO (Transformer Engine's older _extra_state), numpy's array
    reconstruction for the numpy RNG state;
  - any class under `megatron.` is replaced by an inert MegatronObject that only records how it
    was built (Megatron is never imported, none of its code runs).
Any other global (os.system, builtins.eval, ...) stops the load with the file and class named.
"""

import argparse
import io
import pickle
import pickletools
import re
import zipfile
from pathlib import Path

import torch

from megalite.checkpoint.dcp.format import _ALLOWED_GLOBALS, CheckpointError
from megalite.checkpoint.dcp.storage import first_sentence, load_failure


class MegatronObject:
    """Stands in for an instance of a Megatron class (an enum member, a layout object) found in
    a checkpoint: it records the class name and what the pickle built it from."""

    megatron_class = "megatron"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.megatron_class}{self.args!r}>"

    def __eq__(self, other):
        return (isinstance(other, MegatronObject) and other.megatron_class == self.megatron_class
                and other.args == self.args)

    def __hash__(self):
        return hash((self.megatron_class, self.args))


def _stand_in(fqn: str) -> type:
    return type(fqn.rsplit(".", 1)[-1], (MegatronObject,), {"megatron_class": fqn})


def _numpy_globals() -> list:
    """What numpy.random.get_state()'s tuple pickles as: an MT19937 key array (uint32)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    out = [np.ndarray, np.dtype, (reconstruct, "numpy.core.multiarray._reconstruct"),
           (reconstruct, "numpy._core.multiarray._reconstruct")]
    dtypes = getattr(np, "dtypes", None)
    for name in ("UInt32DType", "Int64DType", "Float64DType", "Float32DType"):
        if hasattr(dtypes, name):
            out.append(getattr(dtypes, name))
    return out


def pickled_globals(data: bytes) -> list[str]:
    """'module.name' of every global a pickle names, read from its opcodes without loading it."""
    names, strings = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            names.append(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(".".join(strings[-2:]))
        if isinstance(arg, str):
            strings.append(arg)
    return names


def _pickle_bytes(source) -> bytes:
    """The data.pkl of a torch.save zip file (a path or a file object), or the whole of it for
    the legacy format."""
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if pkl:
                return archive.read(pkl[0])
    return source.getvalue() if isinstance(source, io.BytesIO) else source.read_bytes()


def safe_torch_load(path, data: bytes | None = None) -> object:
    """torch.load(path, weights_only=True) with Megatron's allowlist (see the module doc); or of
    `data`, a torch.save record inside `path` (a torch_dist checkpoint's pickled objects)."""
    path = Path(path)
    source = path if data is None else io.BytesIO(data)
    try:
        names = pickled_globals(_pickle_bytes(source))
    except (ValueError, zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({e})") from None
    allowed = [argparse.Namespace, io.BytesIO, *_numpy_globals()]
    allowed += [(_stand_in(n), n) for n in sorted(set(names)) if n.startswith("megatron.")]
    if data is not None:
        source.seek(0)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(source, map_location="cpu", weights_only=True,
                              mmap=data is None and zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"class {found.group(1)}" if found else f"a pickle weights_only refuses ({load_failure(e)})"
        raise CheckpointError(f"{path}: refusing to unpickle {what} (not on megalite's allowlist for Megatron "
                              "checkpoints; loading never runs code from a checkpoint)") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({first_sentence(e)})") from None


def _dcp_planner_globals() -> dict:
    import torch.distributed.checkpoint.metadata as dcp_metadata
    import torch.distributed.checkpoint.planner as dcp_planner

    classes = [dcp_metadata.BytesStorageMetadata, dcp_planner.SavePlan, dcp_planner.WriteItem,
               dcp_planner.TensorWriteData, dcp_planner.WriteItemType]
    return {(c.__module__, c.__qualname__): c for c in classes}


class _DistMetadataUnpickler(pickle.Unpickler):
    """megalite's DCP metadata allowlist plus what Megatron's torch_dist metadata also names: the
    entries of pickled objects (BytesStorageMetadata, never read) and its saved plans."""

    extra = None

    def find_class(self, module, name):
        if _DistMetadataUnpickler.extra is None:
            _DistMetadataUnpickler.extra = _dcp_planner_globals()
        found = _ALLOWED_GLOBALS.get((module, name)) or self.extra.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refusing to unpickle class {module}.{name}")
        return found


def read_dist_metadata(path: Path):
    """DCP Metadata of a Megatron torch_dist checkpoint (the `.metadata` file)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _DistMetadataUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete torch_dist checkpoint)") from None
    except Exception as e:  # noqa: BLE001 - any failure means the file cannot be trusted
        raise CheckpointError(f"{path}: not a valid checkpoint metadata file ({e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path}: not a valid checkpoint metadata file")
    return metadata
