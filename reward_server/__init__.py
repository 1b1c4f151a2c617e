"""Reward server: scorers behind a small HTTP API (see shared/protocol.py and reward_server/app.py)."""
