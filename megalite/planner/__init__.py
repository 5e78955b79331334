"""The layout planner (tools/plan.py): for a model, a cluster, a global batch and a sequence
length, enumerate the layouts megalite can run, keep those whose predicted memory fits, predict
each one's step time from a compute and communication model and megalite's own pipeline
schedule simulator, and print the best as ready `scripts/pretrain_gpt.sh` flags.

    cluster.py     devices, nodes, links; presets; collective times (ring model or calibrated)
    workload.py    the model (flags, YAML or Hugging Face config.json), batch, precision
    parameters.py  parameters per rank, counted as megalite builds the model
    layouts.py     the candidate layouts and their flags
    memory.py      predicted peak memory per rank (formulas.md)
    compute.py     per-micro-batch compute and tensor/context/expert-parallel communication
    gpu_kernels.py the compute on a GPU whose kernels were measured: kernel classes, host waits
    step.py        one step: the schedule simulator, data-parallel traffic, the optimizer
    search.py      enumerate, filter, rank
    report.py      tables and launch flags
    calibrate.py   measure this machine (matmul, memory bandwidth, gloo/NCCL collectives)
    verify.py      dry runs of the finalists: measured against predicted memory
"""
