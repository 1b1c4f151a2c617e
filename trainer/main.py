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
    args = parse_args(argv)
    from trainer.quiet import quiet_third_party

    quiet_third_party()
    from shared.interrupt import as_interrupt
    from trainer.build import run
    from trainer.config import ConfigError, load_config, saved_dict, user_error_exit
    from trainer.config.describe import described_yaml
    from trainer.health import RewardFailure, TrainingDiverged
    from trainer.launch import RunInterrupted, resume_command, resumed_run_config
    from trainer.rewards.launcher import RewardPoolError
    from trainer.stopping import StopSignalled
    from trainer.tool import tell_launcher

    first_here = os.environ.get("LOCAL_RANK", "0") == "0"  # under torchrun, one process per machine reports
    try:
        overrides = list(args.overrides) + ([f"train.resume={args.resume}"] if args.resume else [])
        config = load_config(args.config, overrides)
        saved = resumed_run_config(config) if not args.config else None
        if saved is not None:  # a resume given no config file continues with the run's own settings
            config = load_config([str(saved)], overrides)
    except ConfigError as exc:
        told = f"config error: {exc}"
        tell_launcher(told)
        if first_here:
            print(told, file=sys.stderr)
        return 2
    if args.show_config:
        print(described_yaml(config, saved_dict(config, absolute=False)), end="")
        return 0
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        with as_interrupt():  # an error that a Ctrl-C became in library code (shared/interrupt.py)
            run(config)
    except KeyboardInterrupt as exc:  # RunInterrupted, or a second Ctrl-C while a first one's stop unwound
        stop = exc
        while stop is not None and not isinstance(stop, RunInterrupted):
            stop = stop.__context__
        if stop is None:
            if rank0:
                print("\ninterrupted before training started: nothing to continue", flush=True)
            return 130
        told = (
            f"{stop.how}: {stop.where}\ncontinue with: {resume_command(args.config, args.overrides, stop.run_dir.name)}"
        )
        tell_launcher(told)
        if rank0:
            print(f"\n{told}", flush=True)
        return stop.code
    except StopSignalled as stop:  # trainer.stopping.StopsBeforeTraining
        if rank0:
            print(f"\n{stop} before training started: nothing to continue", flush=True)
        return 128 + stop.signum
    # User-fixable: bad paths, shapes, sizes (ValueError); a reward replica of the job's own that did not start
    # (the end of its log, in the message, says why).
    except (ValueError, RewardPoolError) as exc:
        return user_error_exit(exc)
    except OSError as exc:  # no room for the run's first files (its checkpoints' own: RunInterrupted)
        from trainer.disk import NO_ROOM

        if exc.errno not in NO_ROOM:
            raise
        where = exc.filename or config.logging.output_dir  # a failed write() names no file
        return user_error_exit(
            ValueError(
                f"cannot write {where}: {exc.strerror}: make room there, or set "
                "logging.output_dir to a folder with room"
            )
        )
    except (RewardFailure, TrainingDiverged) as exc:  # the run went wrong (trainer/health.py), alike on every rank
        exc.every_rank = True
        user_error_exit(exc)
        return 1
    except RuntimeError as exc:  # out of memory before training: loading the model, preparing it (trainer/memory.py)
        from trainer.memory import memory_advice, out_of_memory

        if not out_of_memory(exc):
            raise
        return user_error_exit(ValueError(memory_advice(exc, config)))
    return 0


if __name__ == "__main__":
    from shared.interrupt import run_tool  # Ctrl-C while the trainer's modules load or the config is read

    run_tool(main, "interrupted before training started: nothing to continue")
