"""Megatron-LM's fill-in-the-middle flags (--fim-*; names, defaults and checks from
megatron/training/arguments.py, _add_data_args and validate_args). What they do to samples is
megalite.data.fim's; `fim_transform_from_args` builds it once the tokenizer exists.
"""

from dataclasses import dataclass, fields

from megalite.config.field import arg, flag_of


@dataclass
class MegatronFimArgs:
    """Fill-in-the-middle samples (Megatron's GPTFIMDataset)."""

    fim_data: bool = arg(False, "Make fill-in-the-middle samples (PSM and SPM) from the training data.")
    fim_rate: float = arg(0.5, "Probability that a sample's segment is turned into a FIM segment.")
    fim_spm_rate: float = arg(0.5, "Probability that a FIM segment is in SPM order rather than PSM.")
    fim_split_sample: str | None = arg(
        None, "Token around which a segment is split into fragments, each FIM'd on its own.")
    fim_fragment_rate: float | None = arg(
        None, "Probability of FIM for each fragment (with --fim-split-sample).")
    fim_no_prefix: str | None = arg(None, "Leave segments whose text starts with this as they are.")
    fim_prefix_token: str = arg("<fim_prefix>", "FIM prefix token.")
    fim_middle_token: str = arg("<fim_middle>", "FIM middle token.")
    fim_suffix_token: str = arg("<fim_suffix>", "FIM suffix token.")
    fim_pad_token: str = arg("<fim_pad>", "FIM padding token (fills a sample FIM made shorter).")
    fim_eod_token: str = arg("<|endoftext|>", "FIM end-of-document token (segments are cut at it).")


def check_fim_args(args, fail) -> None:
    """Megatron's checks (validate_args) and the rates' ranges, one line naming the flag."""
    if not args.fim_data:
        return
    if args.mock_data:
        fail("--fim-data and --mock-data contradict each other (Megatron's mock dataset has no FIM)")
    for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
        value = getattr(args, name)
        if value is not None and not 0.0 <= value <= 1.0:
            fail(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")
    if not args.fim_rate or not args.fim_spm_rate:
        fail(f"--fim-data needs a non-zero {'--fim-rate' if not args.fim_rate else '--fim-spm-rate'} (Megatron "
             "asserts both are set)")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        fail("--fim-split-sample needs --fim-fragment-rate")


def fim_notes(args) -> list[str]:
    """One line when FIM flags are given without --fim-data, which alone turns FIM on."""
    if args.fim_data:
        return []
    given = [flag_of(f) for f in fields(MegatronFimArgs) if getattr(args, f.name) != f.default]
    return [f"{given[0]}: no effect without --fim-data (as in Megatron)"] if given else []


def fim_transform_from_args(args, tokenizer):
    """(the datasets' FIM sample transform or None, its start-up lines)."""
    if not args.fim_data:
        return None, []
    from megalite.data.fim import FimText, FimTransform, fim_config_from_options

    text = FimText(tokenizer)
    tokens = {name: getattr(args, f"fim_{name}_token") for name in ("prefix", "middle", "suffix", "pad", "eod")}
    config, notes = fim_config_from_options(text, rate=args.fim_rate, spm_rate=args.fim_spm_rate, tokens=tokens,
                                            split_sample=args.fim_split_sample,
                                            fragment_rate=args.fim_fragment_rate, no_prefix=args.fim_no_prefix)
    notes.append(f"--fim-data: {args.fim_rate:g} of segments FIM'd, {args.fim_spm_rate:g} of them in SPM order "
                 f"(sentinel ids prefix {config.prefix}, middle {config.middle}, suffix {config.suffix}, pad "
                 f"{config.pad}, eod {config.eod}); each sample's draws come from (--seed, sample index)")
    return FimTransform(config, text, args.seed), notes
