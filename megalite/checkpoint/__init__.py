"""Every checkpoint format megalite reads or writes, in one place.

    module              format                                        direction
    dcp_format          megalite's DCP format: tensor chunks, safe    both
                        metadata unpickling, file digests
    dcp_storage         megalite's DCP format on disk: DCP's reader   both
                        and writer, failures named (an unsafe
                        record, a full disk)
    dcp_checkpoint      a training run's megalite checkpoint          save and load (resharding)
    dcp_writer          megalite's DCP format, offline, one tensor    write
    megalite_reader     megalite's DCP format, one full tensor        read
    rng_state           each rank's RNG states (JSON)                 both
    target_layout       megalite's DCP format at a target TP x PP     write (resharding plan)
    megatron_reader     Megatron-LM torch / torch_dist model weights  read
    megatron_names      Megatron-Core names in megalite's             read
    megatron_args       a Megatron-LM checkpoint's args -> GPTConfig  read (by Megatron-LM version)
    megatron_names_mla  ... of multi-latent attention and MTP         read
    megatron_optimizer  Megatron-LM optimizer state                   read
    megatron_buckets    Megatron's distributed-optimizer buckets      read
    megatron_pickle     Megatron's pickles through an allowlist       read (the safe unpickler)
    megatron_resume     Megatron-LM optimizer, schedule, RNG -> a run read
    run_load            --load for a run, whatever wrote it           read
    model_match         --load's model against the stored one         read (refuses a reinterpretation)
    hf_reader           a Hugging Face model directory                read
    hf_mapping(_moe)    Hugging Face family names and configs         both
    hf_config_fields    a Hugging Face config's fields, read once     read
    hf_mapping_deepseek Hugging Face DeepseekV3ForCausalLM (MLA, MTP) both
    hf_weights          Hugging Face state dicts <-> a model chunk    both, in memory
    safetensors_io      safetensors files, one tensor at a time       both
    publish             atomic publication of an output directory     write
    detect              which format a directory holds                read
    integrity           SHA-256 manifests (--verify-integrity)        both

training/ (save, load, resume) and convert/ (the conversion command line) import this package;
it imports neither.
"""
