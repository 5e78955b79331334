"""A Triton kernel as torch.compile's Inductor compiles it when a triton_op launches it: not the
function itself but a copy of its source in a module of Inductor's own.

Inductor (torch/_inductor/codegen/wrapper.py, define_user_defined_triton_kernel) writes a module
holding its common Triton imports (TritonKernel.gen_common_triton_imports: triton, tl,
triton_helpers, libdevice, ...), then ``@triton.jit`` and the source that
user_defined_triton_kernel_transitive_closure_source_code gives: the kernel's source followed by
that of every @jit function it reaches through its globals (pasted under the function's own
name), module-level int/str/bool/constexpr values, and unqualified imports from triton. Inductor
then imports that module and compiles the kernel found in it. `inductor_copy` builds the module
with those same two functions of the installed torch (they run without a GPU) and imports it the
same way; only Inductor's autotuning decorator (a launcher around the function) is left out.

`names_inductor_drops` states the rule the copy imposes independently of the torch version (the
closure walk is the same in torch 2.11 and 2.13, which added constexpr_function): a global a
@jit function reads must be `tl`/`triton`, a builtin, a plain value, or a @jit function under its
own name; anything else (a @jit function bound to another name, a module, a float) is missing
from the copy.
"""

import dis
import hashlib
import importlib.util
from pathlib import Path


def inductor_module_source(kernel) -> str:
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    return (TritonKernel.gen_common_triton_imports() + "\n@triton.jit\n"
            + user_defined_triton_kernel_transitive_closure_source_code(kernel))


def inductor_copy(kernel, directory: Path):
    """The JITFunction Inductor compiles for `kernel`, from a module written under `directory`."""
    source = inductor_module_source(kernel)
    path = Path(directory) / f"inductor_{kernel.__name__}_{hashlib.sha256(source.encode()).hexdigest()[:12]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, kernel.__name__)


def names_inductor_drops(kernel) -> list[str]:
    """'function: name' for each global that a @jit function reachable from `kernel` reads and
    that Inductor's copy would not define."""
    import builtins

    import triton
    from triton.language import constexpr
    from triton.runtime.jit import JITFunction

    dropped, seen, stack = [], set(), [kernel]
    while stack:
        fn = stack.pop()
        if fn.__name__ in seen:
            continue
        seen.add(fn.__name__)
        loads = {i.argval for i in dis.Bytecode(fn.fn) if i.opname == "LOAD_GLOBAL"}
        for name in sorted(loads):
            value = fn.fn.__globals__.get(name, getattr(builtins, name, None))
            if name in ("tl", "triton") or name in vars(builtins):
                continue
            if isinstance(value, JITFunction):  # pasted under its own name: bound to another, it is missing
                if value.__name__ == name:
                    stack.append(value)
                else:
                    dropped.append(f"{fn.__name__}: {name} (the @jit function {value.__name__})")
            elif isinstance(value, (int, str, bool, constexpr)):
                continue
            elif getattr(value, "__module__", "").startswith("triton") and value is not triton:
                continue  # an unqualified import from triton: the copy re-imports it
            else:
                dropped.append(f"{fn.__name__}: {name}")
    return dropped
