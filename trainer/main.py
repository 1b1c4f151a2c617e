"""rewardflow trainer entry point.

    python trainer/main.py                                  # the embedded default job on the CPU
    torchrun --nproc_per_node=2 trainer/main.py             # the same, on two processes (DDP)
    torchrun --nproc_per_node=8 trainer/main.py --config configs/my_run.yaml train.epochs=100

Parse the config, build the parts, fit, close. Any config field can be overridden as section.key=value.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    # Run as a script: Python put trainer/ first on sys.path, where trainer/logging.py would shadow the
    # standard library's logging. Put the repository root there instead.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="trainer/main.py",
        description="Fine-tune a diffusion / flow model with RL against a reward-server pool. With no "
        "arguments: the embedded default (tiny SD3-architecture model, digits, GRPO, local reward "
        "servers) on the CPU.",
        epilog="Overrides: section.key=value, e.g. train.epochs=20 algorithm.group_size=4 "
        "reward.urls=[http://127.0.0.1:8000]. Sections: model, algorithm, warmup, data, reward, "
        "parallel, train, eval, logging. `--show-config` prints every field with its value and description.",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="YAML file with any of the sections; repeatable, later files win (e.g. a model "
        "preset, then configs/algorithms/nft.yaml)",
    )
    parser.add_argument(
        "--show-config",
        action="store_true",
        help="print the resolved config as YAML, each field with its description, and exit",
    )
    parser.add_argument(
        "--resume",
        metavar="auto|DIR",
        help="continue a run: 'auto' takes the newest complete checkpoint of logging.run_name, or "
        "without it of the unfinished run with the newest checkpoint (same as train.resume=...); "
        "without --config, with that run's own config.yaml (overrides on top)",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_intermixed_args(argv)  # options may come after overrides


def main(argv: list[str] | None = None) -> int:
    """Parse, load the config, run the job; how it ended, said in one line, is the exit status (trainer/ending.py)."""
    args = parse_args(argv)
    from trainer.quiet import quiet_third_party

    quiet_third_party()
    from trainer.config import saved_dict
    from trainer.config.describe import described_yaml
    from trainer.ending import RunEnded
    from trainer.run import Run

    try:
        config = run_config(args)
        if args.show_config:
            print(described_yaml(config, saved_dict(config, absolute=False)), end="")
            return 0
        Run(config, args.config, args.overrides).fit()
    except RunEnded as end:
        return end.report()
    return 0


def run_config(args: argparse.Namespace):
    """The config the command line gives (``--resume`` without ``--config``: the continued run's own config.yaml,
    overrides on top), or a ConfigRefused saying why not."""
    from trainer.config import ConfigError, load_config
    from trainer.ending import ConfigRefused
    from trainer.launch import resumed_run_config

    try:
        overrides = list(args.overrides) + ([f"train.resume={args.resume}"] if args.resume else [])
        config = load_config(args.config, overrides)
        saved = resumed_run_config(config) if not args.config else None
        if saved is not None:  # a resume given no config file continues with the run's own settings
            config = load_config([str(saved)], overrides)
    except ConfigError as exc:
        raise ConfigRefused(f"config error: {exc}", 2) from exc
    return config


if __name__ == "__main__":
    from shared.interrupt import run_tool  # Ctrl-C while the trainer's modules load or the config is read

    run_tool(main, "interrupted before training started: nothing to continue")
