"""Options for Gated DeltaNet hybrid linear attention and Qwen3-Next's gated attention:
Megatron-LM's names and defaults. Megatron generates most of them from TransformerConfig's
fields (--experimental-attention-variant, --linear-conv-kernel-dim, --linear-*-head-dim,
--linear-num-*-heads, --attention-output-gate) and declares --linear-attention-freq in
arguments.py (an integer or a Python list expression), --apply-wd-to-qk-layernorm with the
optimizer's flags.

`check_gdn_args` refuses what cannot run, `gdn_model_fields` gives the GPTConfig fields,
`gdn_notes` the start-up lines, `gdn_flags` the flags of a GPTConfig.
"""

import ast
from dataclasses import dataclass, fields

from megalite.config.field import arg, flag_of
from megalite.model.gdn_config import GDNConfig

VARIANTS = ("gdn", "gated_delta_net", "gdn2", "dsa")
_REFUSED = {"gdn2": "Gated DeltaNet 2 (gdn2)", "dsa": "DeepSeek sparse attention (dsa)"}


@dataclass
class GDNArgs:
    """Gated DeltaNet linear attention layers, gated full attention."""

    experimental_attention_variant: str | None = arg(
        None, "gdn: Gated DeltaNet linear attention on the layers --linear-attention-freq picks (gated_delta_net: "
        "its deprecated name). gdn2 and dsa (DeepSeek sparse attention) are Megatron's and refused.",
        choices=VARIANTS)
    linear_attention_freq: str | None = arg(
        None, "Which layers are linear: an integer N (every N-th layer full attention, the others linear) or a "
        "Python list expression of 1 (linear) / 0 (full attention) per layer, e.g. \"([1]*3+[0]*1)*3\".")
    linear_conv_kernel_dim: int = arg(4, "Taps of the short causal depthwise convolution over q, k, v.")
    linear_key_head_dim: int = arg(128, "Query/key channels per linear-attention head.")
    linear_value_head_dim: int = arg(128, "Value channels per linear-attention head.")
    linear_num_key_heads: int = arg(16, "Query/key heads of a linear-attention layer.")
    linear_num_value_heads: int = arg(32, "Value heads of a linear-attention layer (a multiple of the key heads).")
    attention_output_gate: bool = arg(
        False, "Gated full attention (Qwen3-Next): the QKV projection also gives one gate per query head; the "
        "attention output times its sigmoid.")
    apply_wd_to_qk_layernorm: bool = arg(
        False, "Weight decay on the q/k layernorm weights too (Qwen3-Next), the other 1-D parameters and biases "
        "still undecayed.")


def _allowed(node) -> bool:
    if isinstance(node, ast.Expression):
        return _allowed(node.body)
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.List):
        return all(_allowed(e) for e in node.elts)
    return isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)) \
        and _allowed(node.left) and _allowed(node.right)


def parse_linear_attention_freq(text: str) -> int | tuple:
    """Megatron's la_freq_type: an integer, or a list expression of ints, [ ] ( ) + * only
    (evaluated without eval: list literals, + and * over them)."""
    text = text.strip()
    if "[" not in text:
        return int(text)
    tree = ast.parse(text, mode="eval")
    if not _allowed(tree):
        raise ValueError(f"--linear-attention-freq {text!r}: only integers, lists, + and * are allowed")
    value = _evaluate(tree.body)
    if not isinstance(value, list):
        raise ValueError(f"--linear-attention-freq {text!r} is not a list")
    return tuple(value)


def _evaluate(node):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate(e) for e in node.elts]
    left, right = _evaluate(node.left), _evaluate(node.right)
    return left + right if isinstance(node.op, ast.Add) else left * right


def gdn_config_from_args(args) -> GDNConfig | None:
    if args.experimental_attention_variant not in ("gdn", "gated_delta_net"):
        return None
    return GDNConfig(linear_attention_freq=parse_linear_attention_freq(args.linear_attention_freq),
                     linear_conv_kernel_dim=args.linear_conv_kernel_dim,
                     linear_key_head_dim=args.linear_key_head_dim, linear_value_head_dim=args.linear_value_head_dim,
                     linear_num_key_heads=args.linear_num_key_heads,
                     linear_num_value_heads=args.linear_num_value_heads)


def gdn_model_fields(args) -> dict:
    """The GPTConfig fields these flags set."""
    return dict(gdn=gdn_config_from_args(args), attention_output_gate=args.attention_output_gate)


_GDN_ONLY = ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
             "linear_num_key_heads", "linear_num_value_heads")


def check_gdn_args(args, fail) -> None:
    """Refuse what cannot run, with one line naming the flags."""
    defaults = {f.name: f for f in fields(GDNArgs)}
    variant = args.experimental_attention_variant
    if args.apply_wd_to_qk_layernorm and args.optimizer == "muon":
        fail("--apply-wd-to-qk-layernorm with --optimizer muon is not implemented in megalite")
    if args.multi_latent_attention and args.attention_output_gate:
        fail("--attention-output-gate does not apply to --multi-latent-attention in megalite")
    if variant in _REFUSED:
        fail(f"--experimental-attention-variant {variant}: {_REFUSED[variant]} is not implemented in megalite "
             "(gdn is)")
    if variant is None:
        changed = [flag_of(defaults[n]) for n in _GDN_ONLY if getattr(args, n) != defaults[n].default]
        if changed:
            fail(f"{changed[0]} needs --experimental-attention-variant gdn")
        return
    if args.linear_attention_freq is None:
        fail("--experimental-attention-variant gdn needs --linear-attention-freq (as in Megatron)")
    try:
        gdn = gdn_config_from_args(args)
        gdn.layer_pattern(args.num_layers)
    except (ValueError, SyntaxError) as error:
        fail(f"--experimental-attention-variant gdn: {error}")
    tp = args.tensor_model_parallel_size
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        if getattr(args, name) % tp:
            fail(f"{flag_of(defaults[name])} {getattr(args, name)} must be divisible by --tensor-model-parallel-size "
                 f"{tp}")
    cp = args.context_parallel_size
    if cp > 1 and args.linear_num_key_heads % (tp * cp):  # (the value heads are a multiple of the key heads)
        fail(f"--linear-num-key-heads {args.linear_num_key_heads} must be divisible by --tensor-model-parallel-size "
             f"{tp} x --context-parallel-size {cp} = {tp * cp} (each CP rank runs whole heads of the linear-attention "
             "layers over the whole sequence)")


def gdn_notes(args) -> list[str]:
    """One start-up line per flag megalite serves another way."""
    if args.experimental_attention_variant == "gated_delta_net":
        return ["--experimental-attention-variant gated_delta_net is deprecated (Megatron's name for gdn): "
                "use gdn"]
    return []


def gdn_flags(config) -> list[str]:
    """The flags giving a GPTConfig's Gated DeltaNet layers and gated attention."""
    flags = ["--attention-output-gate"] if config.attention_output_gate else []
    gdn = config.gdn
    if gdn is not None:
        freq = gdn.linear_attention_freq
        flags += ["--experimental-attention-variant", "gdn", "--linear-attention-freq",
                  str(freq) if isinstance(freq, int) else str(list(freq)).replace(" ", "")]
        for name in _GDN_ONLY[1:]:
            flags += ["--" + name.replace("_", "-"), str(getattr(gdn, name))]
    return flags
