"""A run's options: the option families (Megatron's flag names and defaults, one dataclass field
each), the --config YAML loader, their validation, and the one boundary where the parsed `args`
become the typed configs the rest of megalite receives (run_config.py).

    args = parse_args(argv)                  # arguments.py: defaults < --config FILE < command line
    config = run_config(args, world_size)    # run_config.py: validated, then typed

megalite's own families: field (the dataclass-field helper), model, mla, moe, mup, context,
dist_opt, run, dry_run; validate.py checks them together. megatron/: the families that exist for
Megatron-LM's scripts (checkpoint, data, fim, logs, model, training). schedules.py: learning-rate
and weight-decay schedules.

Nothing here joins a process group or touches a device.
"""
