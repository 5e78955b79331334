"""A run's options: the option families (Megatron's flag names and defaults, one dataclass field
each, arguments_*.py), the --config YAML loader, their validation, and the one boundary where
the parsed `args` become the typed configs the rest of megalite receives (run_config.py).

    args = parse_args(argv)                  # arguments.py: defaults < --config FILE < command line
    config = run_config(args, world_size)    # run_config.py: validated, then typed

Nothing here joins a process group or touches a device.
"""
