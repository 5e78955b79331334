"""--use-mup's optimizer part, as Megatron-Core's get_mup_config_overrides
(megatron/core/optimizer/__init__.py), with width multiplier m = hidden / base hidden size:

    Adam   hidden matrix-like parameters (2-D or more, not the embeddings or the output layer):
           learning rate (peak and minimum) / m, epsilon / m; everything else keeps the base
    SGD    vector-like parameters (1-D, embeddings, output layer) not in a --decoupled-lr group:
           learning rate (peak and minimum) x m; matrices keep the base

Nothing changes at m = 1. The groups keep their weight-decay settings; the learning-rate
scheduler reads each group's max_lr / min_lr (megalite.training.lr_schedule).
"""

# Megatron marks every embedding parameter and the output layer is_embedding_parameter.
EMBEDDING_CLASS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                   "output_layer.weight")


def vector_like(name: str, param) -> bool:
    return name.endswith(EMBEDDING_CLASS) or param.dim() <= 1


def apply_mup(optimizer, width_mult: float, *, lr: float, min_lr: float, adam_eps: float) -> int:
    """Move the parameters muP scales into groups of their own (see the module docstring);
    returns how many main parameters moved. Call after --decoupled-lr's groups exist and before
    the learning-rate scheduler is built."""
    if width_mult == 1.0:
        return 0
    sgd = optimizer.kind == "sgd"
    scaled = {id(m.main) for m in optimizer.mains if vector_like(m.name, m.param) == sgd}
    factor = width_mult if sgd else 1.0 / width_mult
    override = {"max_lr": lr * factor, "min_lr": min_lr * factor}
    if not sgd:
        override["eps"] = adam_eps * factor
    inner, new_groups = optimizer.inner, []
    for group in inner.param_groups:
        if "max_lr" in group:  # a --decoupled-lr group: its rates are absolute, as Megatron keeps them
            continue
        moved = [p for p in group["params"] if id(p) in scaled]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in scaled]
            settings = {k: v for k, v in group.items() if k != "params"}
            new_groups.append({**settings, **override, "params": moved})
    for group in new_groups:
        inner.add_param_group(group)
    return sum(len(g["params"]) for g in new_groups)
