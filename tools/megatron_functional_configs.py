"""Megatron-LM's functional-test configs against megalite's parser and validation.

Megatron-LM runs each tests/functional_tests/test_cases/<model>/<case>/model_config.yaml by
turning its MODEL_ARGS into a command line (tests/functional_tests/shell_test_utils/_run_training.sh:
envsubst, then yq and bash) on the world size of its recipe (tests/test_utils/recipes/**.yaml:
nodes x gpus; MODEL_ENV_VARS' GPUS_PER_NODE per argument set). This tool does the same for two
sets: the GPT configs (test_cases/gpt, recipes whose spec.model is gpt) and the MoE configs
(test_cases/moe and test_cases/mixtral, recipes whose spec.model is moe):

    # once, from a Megatron-LM checkout: the command lines and world sizes, vendored
    python tools/megatron_functional_configs.py extract --megatron-lm ~/Megatron-LM
    # parse and validate every in-scope config for its own world size, set by set
    python tools/megatron_functional_configs.py count [--set gpt|moe] [--verbose]

In scope: every training config (MODE neither inference nor rl) with a non-empty MODEL_ARGS.
A config with several argument sets (MODEL_ARGS_2, ...) is accepted when all of them are.
In the MoE set, a case no recipe runs (the mixtral and deepseekv3 release configs, and cases whose
recipe lines are commented out; the vendored file lists them under without_recipe) gets the
smallest multiple of 8 GPUs (whole nodes) that its TP x PP x CP and ETP x EP x PP grids divide.
The GPT set keeps 8 for such cases.
"""

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys

import yaml

HERE = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(HERE)
# set name -> (test-case folders, the recipes' spec.model, vendored file)
SETS = {
    "gpt": (("tests/functional_tests/test_cases/gpt",), "gpt",
            os.path.join(REPO, "tests", "config", "megatron_gpt_functional_configs.json")),
    "moe": (("tests/functional_tests/test_cases/moe", "tests/functional_tests/test_cases/mixtral"), "moe",
            os.path.join(REPO, "tests", "config", "megatron_moe_functional_configs.json")),
}
VENDORED = SETS["gpt"][2]
RECIPES = "tests/test_utils/recipes"
DEFAULT_WORLD_SIZE = 8  # recipes/h100/gpt.yaml's spec: 1 node x 8 GPUs
# What run_ci_test.sh / the recipe script export before envsubst (REPEAT: the first repeat).
ENVIRONMENT = {"DATA_PATH": "/mnt/artifacts", "DATA_CACHE_PATH": "/workspace/data/cache",
               "OUTPUT_PATH": "/out", "TENSORBOARD_PATH": "/out/tensorboard",
               "CHECKPOINT_SAVE_PATH": "/out/checkpoints", "CHECKPOINT_LOAD_PATH": "/mnt/artifacts/",
               "REPEAT": "1"}


class _StringLoader(yaml.SafeLoader):
    """YAML with every scalar kept as its source text (yq's `tostring`), merge keys resolved."""


_StringLoader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag in ("tag:yaml.org,2002:merge",
                                                                 "tag:yaml.org,2002:bool")]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _bool(loader, node):
    return node.value == "true" or node.value  # yq's `.value == true` is YAML 1.2's lowercase true


_StringLoader.add_constructor("tag:yaml.org,2002:bool", _bool)


def command_line(model_args: dict) -> list[str]:
    """MODEL_ARGS as _run_training.sh passes them: `true` alone, `[a b]` unbracketed and split,
    a value with spaces, '|' or parentheses one quoted word, anything else split by the shell."""
    argv = []
    for key, value in model_args.items():
        value = str(value).strip() if value is not True else "true"
        if value == "true":
            argv.append(key)
        elif re.fullmatch(r"\([^)]+\)", value):
            argv += [key, value]
        elif re.fullmatch(r"\[[^]]+\]", value):
            argv += [key, *value[1:-1].split()]
        elif any(c in value for c in " |()"):
            argv += [key, value]
        else:
            argv += [key, *value.split()]
    return argv


def envsubst(text: str) -> str:
    """envsubst as _run_training.sh calls it: only variables the environment sets are replaced."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: ENVIRONMENT.get(m.group(1) or m.group(2), m.group(0)), text)


def _git(megatron_lm: str, *args) -> str:
    return subprocess.run(["git", "-C", megatron_lm, *args], check=True, capture_output=True, text=True).stdout


def _read(megatron_lm: str, path: str) -> str:
    return _git(megatron_lm, "show", f"HEAD:{path}")


def recipe_world_sizes(megatron_lm: str, model: str = "gpt") -> dict[str, set[int]]:
    """Test case -> the world sizes (nodes x gpus) of the recipes of `model` that run it."""
    sizes = collections.defaultdict(set)
    for path in _git(megatron_lm, "ls-tree", "-r", "--name-only", "HEAD", RECIPES).split():
        if not path.endswith(".yaml"):
            continue
        recipe = yaml.safe_load(_read(megatron_lm, path))
        spec = recipe.get("spec", {}) if isinstance(recipe, dict) else {}
        if spec.get("model") != model:
            continue
        for product in recipe.get("products", []):
            for case in product.get("test_case", []):
                sizes[case].add(int(spec.get("nodes", 1)) * int(spec.get("gpus", DEFAULT_WORLD_SIZE)))
    return sizes


def _flag_value(argv: list[str], flag: str, default: int = 1) -> int:
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


def smallest_world_size(argv: list[str]) -> int:
    """The fewest whole 8-GPU nodes whose ranks the config's TP x PP x CP and ETP x EP x PP
    grids divide (for a case that no recipe runs)."""
    tp, pp = _flag_value(argv, "--tensor-model-parallel-size"), _flag_value(argv, "--pipeline-model-parallel-size")
    cp, ep = _flag_value(argv, "--context-parallel-size"), _flag_value(argv, "--expert-model-parallel-size")
    etp = _flag_value(argv, "--expert-tensor-parallel-size", tp)
    return math.lcm(DEFAULT_WORLD_SIZE, tp * pp * cp, etp * ep * pp)


def extract(megatron_lm: str, which: str = "gpt") -> dict:
    """Every in-scope config of set `which`: its command lines (one per argument set) and world sizes."""
    folders, model, _ = SETS[which]
    commit = _git(megatron_lm, "rev-parse", "HEAD").strip()
    sizes = recipe_world_sizes(megatron_lm, model)
    configs, skipped, without_recipe = {}, collections.Counter(), []
    paths = sorted(p for folder in folders for p in _git(megatron_lm, "ls-tree", "-r", "--name-only", "HEAD",
                                                         folder).split() if p.endswith("/model_config.yaml"))
    for path in paths:
        case = path.split("/")[-2]
        if case in configs:
            raise ValueError(f"{path}: a second test case named {case}")
        config = yaml.load(envsubst(_read(megatron_lm, path)), Loader=_StringLoader)
        if config.get("MODE") in ("inference", "rl"):
            skipped[f"MODE {config['MODE']}"] += 1
            continue
        if not config.get("MODEL_ARGS"):
            skipped["empty MODEL_ARGS"] += 1
            continue
        per_set = (config.get("MODEL_ENV_VARS") or {})
        runs = []
        for key in sorted((k for k in config if re.fullmatch(r"MODEL_ARGS(_\d+)?", k)),
                          key=lambda k: int(k.split("_")[-1]) if k[-1].isdigit() else 1):
            gpus = (per_set.get(key) or {}).get("GPUS_PER_NODE")
            argv = command_line(config[key])
            if gpus or case in sizes or which == "gpt":
                worlds = sorted({int(gpus)} if gpus else sizes.get(case) or {DEFAULT_WORLD_SIZE})
            else:
                worlds = [smallest_world_size(argv)]
                without_recipe.append(case)
            runs.append({"argument_set": key, "world_sizes": worlds, "argv": argv})
        configs[case] = runs
    source = f"NVIDIA/Megatron-LM {commit}, {', '.join(f + '/*/model_config.yaml' for f in folders)} and {RECIPES}"
    result = {"source": source, "out_of_scope": dict(skipped), "configs": configs}
    if without_recipe:
        result["without_recipe"] = sorted(set(without_recipe))
    return result


def pack(extracted: dict) -> dict:
    """The vendored form: each distinct command-line word once, command lines as indices."""
    words, index = [], {}
    for runs in extracted["configs"].values():
        for run in runs:
            run["argv"] = [index.setdefault(w, len(index)) for w in run["argv"]]
    words = sorted(index, key=index.get)
    return {**extracted, "words": words}


def load(path: str = VENDORED) -> dict:
    """Case -> [(argument set, world sizes, argv)] from the vendored file."""
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    words = data["words"]
    return {case: [(r["argument_set"], r["world_sizes"], [words[i] for i in r["argv"]]) for r in runs]
            for case, runs in data["configs"].items()}


def check(argv: list[str], world_size: int) -> str | None:
    """None when megalite parses and validates `argv` for `world_size` processes, else its error."""
    from megalite.config.arguments import parse_args, validate_args

    try:
        validate_args(parse_args(argv), world_size)
    except ValueError as error:
        return str(error)
    return None


def flag_occurrences(argv: list[str]) -> list[str]:
    return [word for word in argv if word.startswith("--")]


def count(configs: dict) -> dict:
    """{accepted: [case], refused: {case: error}, flags: (known occurrences, all occurrences)}."""
    from megalite.config.arguments import build_parser

    known = {s for action in build_parser()._actions for s in action.option_strings}
    accepted, refused, occurrences, known_occurrences = [], {}, 0, 0
    for case, runs in sorted(configs.items()):
        errors = [f"{name} at world size {world}: {error}" if len(runs) > 1 else
                  (f"world size {world}: {error}" if len(worlds) > 1 else error)
                  for name, worlds, argv in runs for world in worlds
                  if (error := check(argv, world)) is not None]
        for _, _, argv in runs[:1]:
            flags = flag_occurrences(argv)
            occurrences += len(flags)
            known_occurrences += sum(f in known for f in flags)
        if errors:
            refused[case] = errors[0]
        else:
            accepted.append(case)
    return {"accepted": accepted, "refused": refused, "flags": (known_occurrences, occurrences)}


def _report(name: str, path: str, verbose: bool) -> None:
    result = count(load(path))
    total = len(result["accepted"]) + len(result["refused"])
    known, occurrences = result["flags"]
    print(f"{name}: {len(result['accepted'])} of {total} configs parse and validate for their own world size; "
          f"{known} of {occurrences} flag occurrences ({100 * known / occurrences:.1f}%) are flags megalite knows")
    reasons = collections.Counter(re.sub(r"\d+", "N", e.split(": ", 1)[-1] if "world size" in e else e)[:110]
                                  for e in result["refused"].values())
    for reason, n in reasons.most_common():
        print(f"  {n:3d}  {reason}")
    if verbose:
        for case, error in result["refused"].items():
            print(f"{case}: {error}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("extract", help="vendor the configs of a Megatron-LM checkout")
    get.add_argument("--megatron-lm", required=True, help="a git checkout of NVIDIA/Megatron-LM")
    get.add_argument("--set", choices=sorted(SETS), help="one set (default: both, each to its own file)")
    get.add_argument("--output", help="the vendored file (only with --set; default: the set's own)")
    tally = commands.add_parser("count", help="parse and validate the vendored configs")
    tally.add_argument("--set", choices=sorted(SETS), help="one set (default: both, reported separately)")
    tally.add_argument("--input", help="a vendored file (only with --set; default: the set's own)")
    tally.add_argument("--verbose", action="store_true", help="one line per refused config")
    options = parser.parse_args(argv)
    path_option = options.output if options.command == "extract" else options.input
    if path_option and not options.set:
        parser.error(f"--{'output' if options.command == 'extract' else 'input'} needs --set")
    for name in [options.set] if options.set else list(SETS):
        path = path_option or SETS[name][2]
        if options.command == "count":
            _report(name, path, options.verbose)
            continue
        data = pack(extract(options.megatron_lm, name))
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(data, handle, separators=(",", ":"))
            handle.write("\n")
        print(f"{name}: {len(data['configs'])} in-scope configs ({data['source']}); "
              f"out of scope: {data['out_of_scope']}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
