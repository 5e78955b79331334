"""Only so that Megatron-Core's GatedDeltaNet imports: see fla/__init__.py."""


def chunk_gated_delta_rule(*args, **kwargs):
    raise NotImplementedError("the fla stand-in has no chunk_gated_delta_rule: build Megatron-Core's GatedDeltaNet "
                              "with deterministic_mode=True (its torch_chunk_gated_delta_rule)")
