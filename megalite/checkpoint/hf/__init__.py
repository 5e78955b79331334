"""Hugging Face model directories, both directions: family names and configs (mapping,
mapping_moe, mapping_deepseek, mapping_qwen3_next,
config_fields), state dicts to and from a model chunk (weights),
safetensors files one tensor at a time (safetensors_io) and a model directory read (reader)."""
