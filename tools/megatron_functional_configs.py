"""Megatron-LM's GPT functional-test configs against megalite's parser and validation.

Megatron-LM runs each tests/functional_tests/test_cases/gpt/<case>/model_config.yaml by turning
its MODEL_ARGS into a command line (tests/functional_tests/shell_test_utils/_run_training.sh:
envsubst, then yq and bash) on the world size of its recipe (tests/test_utils/recipes/**.yaml:
nodes x gpus; MODEL_ENV_VARS' GPUS_PER_NODE per argument set). This tool does the same:

    # once, from a Megatron-LM checkout: the command lines and world sizes, vendored
    python tools/megatron_functional_configs.py extract --megatron-lm ~/Megatron-LM \
        --output tests/config/megatron_gpt_functional_configs.json
    # parse and validate every in-scope config for its own world size
    python tools/megatron_functional_configs.py count [--verbose]

In scope: every training config (MODE neither inference nor rl) with a non-empty MODEL_ARGS.
A config with several argument sets (MODEL_ARGS_2, ...) is accepted when all of them are.
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys

import yaml

HERE = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(HERE)
VENDORED = os.path.join(REPO, "tests", "config", "megatron_gpt_functional_configs.json")
CASES = "tests/functional_tests/test_cases/gpt"
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


def recipe_world_sizes(megatron_lm: str) -> dict[str, set[int]]:
    """Test case -> the world sizes (nodes x gpus) of the GPT recipes that run it."""
    sizes = collections.defaultdict(set)
    for path in _git(megatron_lm, "ls-tree", "-r", "--name-only", "HEAD", RECIPES).split():
        if not path.endswith(".yaml"):
            continue
        recipe = yaml.safe_load(_read(megatron_lm, path))
        spec = recipe.get("spec", {}) if isinstance(recipe, dict) else {}
        if spec.get("model") != "gpt":
            continue
        for product in recipe.get("products", []):
            for case in product.get("test_case", []):
                sizes[case].add(int(spec.get("nodes", 1)) * int(spec.get("gpus", DEFAULT_WORLD_SIZE)))
    return sizes


def extract(megatron_lm: str) -> dict:
    """Every in-scope config: its command lines (one per argument set) and world sizes."""
    commit = _git(megatron_lm, "rev-parse", "HEAD").strip()
    sizes = recipe_world_sizes(megatron_lm)
    configs, skipped = {}, collections.Counter()
    paths = sorted(p for p in _git(megatron_lm, "ls-tree", "-r", "--name-only", "HEAD", CASES).split()
                   if p.endswith("/model_config.yaml"))
    for path in paths:
        case = path.split("/")[-2]
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
            worlds = sorted({int(gpus)} if gpus else sizes.get(case) or {DEFAULT_WORLD_SIZE})
            runs.append({"argument_set": key, "world_sizes": worlds, "argv": command_line(config[key])})
        configs[case] = runs
    return {"source": f"NVIDIA/Megatron-LM {commit}, {CASES}/*/model_config.yaml and {RECIPES}",
            "out_of_scope": dict(skipped), "configs": configs}


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("extract", help="vendor the configs of a Megatron-LM checkout")
    get.add_argument("--megatron-lm", required=True, help="a git checkout of NVIDIA/Megatron-LM")
    get.add_argument("--output", default=VENDORED)
    tally = commands.add_parser("count", help="parse and validate the vendored configs")
    tally.add_argument("--input", default=VENDORED)
    tally.add_argument("--verbose", action="store_true", help="one line per refused config")
    options = parser.parse_args(argv)
    if options.command == "extract":
        data = pack(extract(options.megatron_lm))
        with open(options.output, "w", encoding="utf-8") as handle:
            json.dump(data, handle, separators=(",", ":"))
            handle.write("\n")
        print(f"{len(data['configs'])} in-scope configs ({data['source']}); out of scope: {data['out_of_scope']}")
        return 0
    result = count(load(options.input))
    total = len(result["accepted"]) + len(result["refused"])
    known, occurrences = result["flags"]
    print(f"{len(result['accepted'])} of {total} configs parse and validate for their own world size; "
          f"{known} of {occurrences} flag occurrences ({100 * known / occurrences:.1f}%) are flags megalite knows")
    reasons = collections.Counter(re.sub(r"\d+", "N", e.split(": ", 1)[-1] if "world size" in e else e)[:110]
                                  for e in result["refused"].values())
    for reason, n in reasons.most_common():
        print(f"  {n:3d}  {reason}")
    if options.verbose:
        for case, error in result["refused"].items():
            print(f"{case}: {error}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.exit(main())
