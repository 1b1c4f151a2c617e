"""Every parallel backend against a single-process replica, under torchrun with 2 gloo processes.

The worker (this file run by torchrun) trains a small block network with each backend on a
world-size-invariant batch (each rank takes its half of one global batch; the replica takes all of it), so
the backend must reproduce the replica's gradient norms and weights. It also checks ``local_shards``
(what the EMA keeps and swaps), ``gathered``, ``frozen_copy``, loading full trainable weights, the optimizer
state round trip and a checkpoint written and read through ``trainer.checkpoint`` (each rank's global RNG
streams are restored). An auxiliary network (a critic: ``prepare_auxiliary``) trains in the same backward with
its own optimizer and must match its replica too. A step with non-finite gradients on one rank is skipped by all.
"""

from __future__ import annotations

import copy
import math
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("ddp", "fsdp2", "zero2", "zero3")
TOL = 1e-5
"""Relative tolerance against the replica: the backends reduce gradients in another order (two halves
summed by a collective) than one process computes them, so float32 sums differ in the last bits."""


def test_backends_match_a_single_process_replica(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    for backend in BACKENDS:
        assert f"ok {backend} rank 0" in out.stdout and f"ok {backend} rank 1" in out.stdout, out.stdout


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(nn.Module):
    """Blocks (the shard units) between odd-sized layers, so that shards are uneven."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 12)
        self.blocks = nn.ModuleList(Block(12) for _ in range(3))
        self.out = nn.Linear(12, 3)
        self.register_buffer("scale", torch.tensor(0.5))
        self.frozen = nn.Linear(3, 3).requires_grad_(False)  # like a LoRA base: never trained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.frozen(self.out(x)) * self.scale


class Adapter:
    """What ``Checkpoints`` reads of an adapter: its denoiser."""

    def __init__(self, denoiser: nn.Module):
        self.denoiser = denoiser


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= TOL * scale, (what, float((a - b).abs().max()), scale)


def _all_gathers(counter) -> int:
    return sum(n for op, n in counter.ops.items() if "allgather" in op or "all_gather" in op)


def _worker(kind: str, tmp: Path):
    from trainer.checkpoint import Checkpoints, Progress
    from trainer.config import ParallelConfig
    from trainer.distributed import init_backend
    from trainer.kernels import KernelCounter
    from trainer.state import State

    backend = init_backend(ParallelConfig(backend=kind), torch.device("cpu"), max_grad_norm=0.05)
    rank, world = backend.world.rank, backend.world.world_size
    torch.manual_seed(0)
    net = Net()
    replica = copy.deepcopy(net)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)  # noqa: E731
    policy = backend.prepare(net, [p for p in net.parameters() if p.requires_grad], make, shard_units=(Block,))
    ref_opt = make([p for p in replica.parameters() if p.requires_grad])
    params = [dict(net.named_parameters())[n] for n in names]
    critic = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    replica_critic = copy.deepcopy(critic)
    make_critic = lambda ps: torch.optim.AdamW(ps, lr=3e-2)  # noqa: E731
    critic_train = backend.prepare_auxiliary(critic, make_critic)
    critic_names = [n for n, _ in critic.named_parameters()]
    critic_params = list(critic.parameters())
    ref_critic_opt = make_critic(list(replica_critic.parameters()))
    g = torch.Generator().manual_seed(1)
    x_all, y_all = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)

    def losses(net: nn.Module, value: nn.Module, rows: torch.Tensor, step: int) -> torch.Tensor:
        """The policy's loss plus a critic's value loss (its target depends on the policy's output, detached)."""
        out = net(x_all[rows] + step)
        return (out - y_all[rows]).pow(2).mean() + (value(x_all[rows]) - out.detach()[:, :1]).pow(2).mean()

    def train_step(step: int) -> None:
        """Two accumulated micro-batches; rank r holds rows r::world of each."""
        ref_opt.zero_grad()
        ref_critic_opt.zero_grad()
        for unit in range(2):
            rows = torch.arange(4) + 4 * unit
            with backend.sync(unit == 1):
                backend.backward(losses(policy, critic_train, rows[rank::world], step) / 2)
            (losses(replica, replica_critic, rows, step) / 2).backward()
        ref_params = [p for p in replica.parameters() if p.requires_grad]
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref_params, 0.05))
        torch.nn.utils.clip_grad_norm_(replica_critic.parameters(), 0.05)
        ref_opt.step()
        ref_critic_opt.step()
        norm = backend.step(0.05)
        assert abs(norm - ref_norm) <= TOL * ref_norm, (kind, step, norm, ref_norm)

    def check_weights(what: str) -> None:
        with backend.gathered(params) as full:
            for name, value in zip(names, full, strict=True):
                _close(value, dict(replica.named_parameters())[name].detach(), f"{kind} {what} {name}")
        with backend.gathered(critic_params) as full:
            for name, value in zip(critic_names, full, strict=True):
                _close(value, dict(replica_critic.named_parameters())[name].detach(), f"{kind} {what} critic {name}")

    check_weights("initial")
    for step in range(3):
        train_step(step)
    check_weights("after 3 steps")

    # local_shards: this rank's part of each parameter, the storage the forward reads (EMA swaps there).
    shards = backend.local_shards(params)
    with backend.gathered(params) as full:
        full = [t.clone() for t in full]
    for name, shard, whole in zip(names, shards, full, strict=True):
        flat = whole.reshape(-1)
        if kind == "fsdp2":
            chunks = whole.chunk(world)
            expected = chunks[rank] if rank < len(chunks) else whole[:0]
            assert torch.equal(shard, expected), (name, shard.shape, expected.shape)
        elif kind == "zero3" and shard.numel() != whole.numel():
            size = -(-flat.numel() // world)
            part = flat[rank * size : (rank + 1) * size]
            assert shard.numel() == size and torch.equal(shard[: len(part)], part), name
        else:
            assert torch.equal(shard, whole), name
    x = x_all[:2]
    sharded = kind in ("fsdp2", "zero3")
    with torch.no_grad(), KernelCounter() as outside:
        policy(x)
    assert (_all_gathers(outside) > 0) == sharded, (kind, outside.ops)
    with backend.sampling(), torch.no_grad():  # the weights stay gathered from the first forward on
        _close(policy(x), replica(x), f"{kind} first forward while sampling")
        with KernelCounter() as inside:
            _close(policy(x + 1), replica(x + 1), f"{kind} second forward while sampling")
        assert _all_gathers(inside) == 0, (kind, inside.ops)
    # After the sampling context, writes into the shards reach the next forward (it resharded).
    with torch.no_grad():
        saved = [s.clone() for s in shards]
        for s in shards:
            s.zero_()
        zeroed = copy.deepcopy(replica)
        for p in zeroed.parameters():
            if p.requires_grad:
                p.zero_()
        _close(policy(x), zeroed(x), f"{kind} forward with zeroed shards")
        with backend.sampling():  # written before sampling starts (an EMA swap): the gathered weights have it
            _close(policy(x), zeroed(x), f"{kind} sampling with zeroed shards")
        for s, v in zip(shards, saved, strict=True):
            s.copy_(v)
        _close(policy(x), replica(x), f"{kind} forward after restoring shards")

    # frozen_copy: a plain module with the full weights on every rank, no collective in its forward.
    reference = backend.frozen_copy(policy)
    assert all(type(p) is nn.Parameter and not p.requires_grad for p in reference.parameters())
    assert torch.equal(reference.scale, replica.scale) and not reference.training
    with torch.no_grad():
        _close(reference(x), replica(x), f"{kind} frozen copy")
        if rank == 0:  # a forward on one rank only: would hang if the copy were still sharded
            reference(x)

    # main_copy: the same weights on rank 0's CPU only (what exports write), its own storage.
    exported = backend.main_copy(policy)
    if rank == 0:
        assert all(p.device.type == "cpu" and not p.requires_grad for p in exported.parameters())
        assert not {p.data_ptr() for p in exported.parameters()} & {p.data_ptr() for p in policy.parameters()}
        with torch.no_grad():
            _close(exported(x.cpu()), replica(x).cpu(), f"{kind} main copy")
    else:
        assert exported is None

    # A checkpoint through trainer.checkpoint, then a different step, then back: the step repeats exactly.
    checkpoints = Checkpoints(tmp / kind, keep=1, is_main=rank == 0)
    ema_like = {"shard": shards[0].clone()}
    critic_state = dict(zip(critic_names, (t.clone() for t in backend.local_shards(critic_params)), strict=True))
    checkpoints.save(
        Progress(1, 2, True),
        Adapter(net),
        backend,
        {"ema": State(ema_like, per_rank=True), "critic": State(critic_state, per_rank=True)},
        {},
    )
    drawn = (torch.rand(3), np.random.rand(3), random.random())  # the global streams as saved
    trainable = backend.trainable_state(net)
    if rank == 0:
        assert sorted(trainable) == sorted(names)
        for name in names:
            _close(trainable[name], dict(replica.named_parameters())[name].detach(), f"{kind} state {name}")
    else:
        assert trainable == {}
    saved_replica = copy.deepcopy((replica.state_dict(), replica_critic.state_dict()))
    saved_ref_opt = copy.deepcopy((ref_opt.state_dict(), ref_critic_opt.state_dict()))
    train_step(10)
    path = backend.broadcast(str(checkpoints.latest()) if rank == 0 else None)
    torch.manual_seed(1234 + rank)
    np.random.seed(1234)
    random.seed(1234)
    progress, states = checkpoints.load(Path(path), Adapter(net), backend)
    assert progress == Progress(1, 2, True) and torch.equal(states["ema"]["shard"], ema_like["shard"])
    with torch.no_grad():
        for shard, name in zip(backend.local_shards(critic_params), critic_names, strict=True):
            shard.copy_(states["critic"][name])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(again[0], drawn[0]) and (again[1] == drawn[1]).all() and again[2] == drawn[2], kind
    replica.load_state_dict(saved_replica[0])
    replica_critic.load_state_dict(saved_replica[1])
    ref_opt.load_state_dict(saved_ref_opt[0])
    ref_critic_opt.load_state_dict(saved_ref_opt[1])
    check_weights("after loading the checkpoint")
    train_step(11)
    check_weights("after a step from the checkpoint")

    # load_trainable_state writes full values into every rank's shards (and DeepSpeed's master weights).
    shifted = {n: t + 0.25 for n, t in ((n, p.detach()) for n, p in replica.named_parameters() if p.requires_grad)}
    backend.load_trainable_state(net, shifted)
    replica.load_state_dict(shifted, strict=False)
    train_step(12)
    check_weights("after loading shifted weights and a step")

    # A step whose gradients are not finite (rank 0's alone here: reduced, they are NaN on every rank) is skipped
    # by every rank alike, policy and critic: the weights and the optimizers' moments stay as they were.
    for unit in range(2):
        rows = torch.arange(4) + 4 * unit
        with backend.sync(unit == 1):
            backend.backward(losses(policy, critic_train, rows[rank::world], 13) * (math.nan if rank == 0 else 0.5))
    assert not math.isfinite(backend.step(0.05)), kind
    check_weights("after a skipped step")
    train_step(14)
    check_weights("after a step following a skipped one")
    _loop_collectives(backend, tmp / f"{kind}-rank{rank}.jsonl", kind)
    backend.barrier()
    print(f"ok {kind} rank {rank}", flush=True)
    return backend


def _loop_collectives(backend, pool: Path, kind: str) -> None:
    """The loop's own collectives: a stop signal that reached rank 1 alone is agreed on by both ranks, and the
    rollouts' breakdown by tag covers both ranks' items (rank r scored pool items 3r..3r+2, item i scoring i)."""
    import json
    import signal

    from trainer.data.prompt_file import PromptFileTask
    from trainer.evaluation import RolloutBreakdown
    from trainer.stopping import StopRequests

    rank = backend.world.rank
    stops = StopRequests(backend, announce=False)
    stops.received = signal.SIGTERM if rank == 1 else 0
    assert stops.asked() == signal.SIGTERM, kind
    tags = ["a", "b", "a", "c", "a", "b"]
    pool.write_text("".join(json.dumps({"tag": t, "prompt": f"thing {i}"}) + "\n" for i, t in enumerate(tags)))
    mine = [3 * rank, 3 * rank + 1, 3 * rank + 2]
    got = RolloutBreakdown(PromptFileTask(str(pool), eval_count=0), "tag", backend)(mine, {"s": np.array(mine, float)})
    assert got == {
        "rollout_by_tag/s/a": 2.0,
        "rollout_by_tag/s/b": 3.0,
        "rollout_by_tag/s/c": 3.0,
        "rollout_by_tag/s/mean": 8 / 3,
    }, (kind, got)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tmp = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    for kind in BACKENDS:
        backend = _worker(kind, tmp)
    backend.close()
    # Not through the interpreter's finalisation: a gloo worker thread may still be freeing the last collective's
    # work (holding Python tensors) and then takes the GIL from a finalising interpreter, which kills the thread
    # inside a noexcept destructor: std::terminate, SIGABRT (1 run in ~10 on 2 loaded cores; seen in a core dump).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
