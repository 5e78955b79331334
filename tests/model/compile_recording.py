"""A torch.compile backend for tests: AOTAutograd with eager execution (aot_eager) that keeps the
forward and backward graphs it is given and counts the compiled forwards' calls."""

import functools

from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition


class RecordingBackend:
    """`inductor_partition`: decompose and split forward and backward as inductor does (its
    decompositions, its min-cut rematerialisation), so that what the forward graphs return
    beside the outputs is what inductor would save for backward."""

    def __init__(self, inductor_partition: bool = False):
        self.graphs = {"forward": [], "backward": []}
        self.forward_calls = 0

        def compiler(kind):
            def compile_graph(gm, example_inputs):
                self.graphs[kind].append(gm)

                def run(*args):
                    self.forward_calls += kind == "forward"
                    return gm(*args)
                return make_boxed_func(run)
            return compile_graph
        partition = {}
        if inductor_partition:
            from torch._inductor.decomposition import select_decomp_table

            partition["partition_fn"] = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
            partition["decompositions"] = select_decomp_table()
        self.backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), **partition)

    def code(self, kind) -> str:
        return "\n".join(sub.code for gm in self.graphs[kind] for sub in gm.modules() if hasattr(sub, "code"))

    def forward_returns(self, graph) -> list:
        """The fake values a forward graph returns: its outputs, then what it saves for backward."""
        output = next(n for n in graph.graph.nodes if n.op == "output")
        return [a.meta["val"] for a in output.args[0] if hasattr(a, "meta") and "val" in a.meta]
