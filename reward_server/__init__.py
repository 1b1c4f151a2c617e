"""Reward server: scorers behind a small HTTP API (see shared/protocol.py and reward_server/app.py)."""


def run() -> None:
    """``python -m reward_server``, and the ``rewardflow-reward-server`` script: the server's libraries load after
    its Ctrl-C handler is in place, so that a Ctrl-C before it serves is one line (shared/interrupt.py)."""
    from shared.interrupt import run_module

    run_module("reward_server.__main__", "interrupted: the server did not start")
