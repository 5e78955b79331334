"""Every checkpoint format megalite reads or writes, in one place: one sub-package per format,
what all formats share at the top.

    dcp/        megalite's own format (torch.distributed.checkpoint): save and load with
                resharding, safe metadata, offline writers, RNG states, integrity manifests
    megatron/   Megatron-LM's torch and torch_dist checkpoints: model weights, arguments,
                optimizer state, resume, through an allowlist unpickler (read)
    hf/         Hugging Face model directories and safetensors files (both directions)

    module              format                                        direction
    publish             atomic publication of an output directory     write
    detect              which format a directory holds                read
    megalite_reader     megalite's DCP format, one full tensor        read
    run_load            --load for a run, whatever wrote it           read
    model_match         --load's model against the stored one         read (refuses a reinterpretation)

    dcp.format          megalite's DCP format: tensor chunks, safe    both
                        metadata unpickling, file digests
    dcp.storage         megalite's DCP format on disk: DCP's reader   both
                        and writer, failures named (an unsafe
                        record, a full disk)
    dcp.checkpoint      a training run's megalite checkpoint          save and load (resharding)
    dcp.writer          megalite's DCP format, offline, one tensor    write
    dcp.rng_state       each rank's RNG states (JSON)                 both
    dcp.target_layout   megalite's DCP format at a target TP x PP     write (resharding plan)
    dcp.integrity       SHA-256 manifests (--verify-integrity)        both
    megatron.reader     Megatron-LM torch / torch_dist model weights  read
    megatron.torch_files Megatron-LM torch files: which rank holds what read (TP, PP, EP, ETP slices)
    megatron.names      Megatron-Core names in megalite's             read
    megatron.names_mla  ... of multi-latent attention and MTP         read
    megatron.names_gdn  ... of Gated DeltaNet and gated attention      read
    megatron.args       a Megatron-LM checkpoint's args -> GPTConfig  read (by Megatron-LM version)
    megatron.optimizer  Megatron-LM optimizer state                   read
    megatron.buckets    Megatron's distributed-optimizer buckets      read
    megatron.dp_reshardable Megatron's default torch_dist dist-optimizer layout read
    megatron.safe_pickle Megatron's pickles through an allowlist      read (the safe unpickler)
    megatron.resume     Megatron-LM optimizer, schedule, RNG -> a run read
    hf.reader           a Hugging Face model directory                read
    hf.mapping(_moe)    Hugging Face family names and configs         both
    hf.mapping_deepseek Hugging Face DeepseekV3ForCausalLM (MLA, MTP) both
    hf.mapping_qwen3_next Hugging Face Qwen3NextForCausalLM (GDN)     both
    hf.config_fields    a Hugging Face config's fields, read once     read
    hf.weights          Hugging Face state dicts <-> a model chunk    both, in memory
    hf.safetensors_io   safetensors files, one tensor at a time       both

Arrows: dcp/ imports no other format; megatron/ and hf/ may import dcp/ (Megatron's torch_dist
is DCP too) and publish, never each other. training/ (save, load, resume) and convert/ (the
conversion command line) import this package; it imports neither.
"""
