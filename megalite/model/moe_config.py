"""Shape and behaviour of mixture-of-experts layers. Field names follow Megatron's --moe-* flags."""

import ast
from dataclasses import asdict, dataclass

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = (None, "fp32", "fp64")


def parse_layer_freq(value) -> int | list[int]:
    """--moe-layer-freq: an integer N (layers 0, N, 2N, ... are MoE) or a list of 0/1 per layer,
    written as a Python list literal, optionally as Megatron's repetition expression
    "([0]+[1]*3)*2". Parsed without evaluating code."""
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        result = _eval_pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"--moe-layer-freq {value!r}: not an integer or a list of 0/1 ({err})") from None
    return result


def _eval_pattern(node):
    if isinstance(node, ast.List):
        items = [_eval_pattern(e) for e in node.elts]
        if not all(isinstance(i, int) for i in items):
            raise ValueError("list items must be 0 or 1")
        return items
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) and right >= 0:
            return left * right
    raise ValueError("only list literals, + and * by an integer are allowed")


@dataclass
class MoEConfig:
    """Mixture of experts in place of the dense MLP of some layers."""

    num_experts: int
    """Routed experts per MoE layer (--num-experts)."""
    ffn_hidden_size: int
    """Inner width of each routed expert (--moe-ffn-hidden-size)."""
    layer_freq: int | list = 1
    """--moe-layer-freq: N (every N-th layer from layer 0) or one 0/1 per layer."""
    router_topk: int = 2
    """Experts per token (--moe-router-topk)."""
    score_function: str = "softmax"
    """'softmax' or 'sigmoid' (--moe-router-score-function)."""
    pre_softmax: bool = False
    """Softmax over all experts before the top-k (--moe-router-pre-softmax)."""
    topk_scaling_factor: float | None = None
    """Multiplies the top-k probabilities (--moe-router-topk-scaling-factor)."""
    router_dtype: str | None = None
    """None (the input's dtype), 'fp32' or 'fp64': dtype of the router logits and scores."""
    num_groups: int | None = None
    """Expert groups for group-limited routing (--moe-router-num-groups)."""
    group_topk: int | None = None
    """Groups each token may use (--moe-router-group-topk)."""
    load_balancing_type: str = "aux_loss"
    """'aux_loss' (per micro-batch), 'seq_aux_loss' (per sequence), 'global_aux_loss' (the token
    counts of the global batch: every DP x CP rank's micro-batches so far in the step), 'sinkhorn'
    (S-BASE's balanced top-k choice, no loss) or 'none'."""
    aux_loss_coeff: float = 0.0
    """--moe-aux-loss-coeff."""
    z_loss_coeff: float | None = None
    """--moe-z-loss-coeff."""
    enable_expert_bias: bool = False
    """Auxiliary-loss-free balancing: a per-expert bias added to the scores for the top-k only."""
    bias_update_rate: float = 1e-3
    """Step of the expert bias per optimizer step (--moe-router-bias-update-rate)."""
    capacity_factor: float | None = None
    """Expert capacity = ceil(tokens * topk / experts * factor); None drops nothing."""
    pad_to_capacity: bool = False
    """Every expert receives exactly its capacity in rows (--moe-pad-expert-input-to-capacity)."""
    token_drop_policy: str = "probs"
    """Over capacity, keep the highest-probability ('probs') or earliest ('position') tokens."""
    shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token passes through (None: none)."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w_gate) (Qwen2-MoE)."""
    grouped_gemm: bool = False
    """Run the local experts with torch's grouped matmul where the device supports it."""
    token_dispatcher_type: str = "allgather"
    """'allgather' or 'alltoall' (--moe-token-dispatcher-type)."""

    def __post_init__(self):
        self.layer_freq = parse_layer_freq(self.layer_freq)
        for name, allowed in (("score_function", SCORE_FUNCTIONS), ("load_balancing_type", LOAD_BALANCING),
                              ("token_drop_policy", DROP_POLICIES), ("router_dtype", ROUTER_DTYPES),
                              ("token_dispatcher_type", ("allgather", "alltoall"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoEConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def is_moe_layer(self, layer_number: int, num_layers: int) -> bool:
        """Whether layer `layer_number` has experts; an MTP depth's layer (numbered from
        num_layers) has them when the last layer has, as Megatron builds it."""
        pattern = self.layer_pattern(num_layers)
        return bool(pattern[min(layer_number, num_layers - 1)])

    def layer_pattern(self, num_layers: int) -> list[int]:
        if isinstance(self.layer_freq, int):
            return [int(i % self.layer_freq == 0) for i in range(num_layers)]
        if len(self.layer_freq) != num_layers or any(v not in (0, 1) for v in self.layer_freq):
            raise ValueError(f"--moe-layer-freq {self.layer_freq}: needs one 0 or 1 per layer "
                             f"({num_layers} layers)")
        return list(self.layer_freq)

    def to_dict(self) -> dict:
        return asdict(self)
