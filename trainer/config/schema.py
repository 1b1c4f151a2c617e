"""The config schema: one dataclass per section (model, algorithm, warmup, data, reward, parallel, train,
eval, logging). ``Config()`` is the embedded default: the tiny SD3-architecture model on the digits task,
supervised warm-up, then GRPO against the ``digit`` reward served by local replicas. Every field says why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from shared.rewards import check_weights
from trainer.algorithms.sft import SFTConfig
from trainer.config.fields import (
    Bounds,
    Decay,
    FiniteFloat,
    LocalPath,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Seed,
    Selected,
    did_you_mean,
    renamed,
)

logger = logging.getLogger(__name__)


def _models() -> dict[str, type]:
    from trainer.models import MODELS

    return {name: spec.config_class for name, spec in MODELS.items()}


def _algorithms() -> dict[str, type]:
    from trainer.algorithms import ALGORITHMS

    return {name: spec.config_class for name, spec in ALGORITHMS.items()}


def _default_model() -> Any:
    return _models()["tiny"]()


def _default_algorithm() -> Any:
    """GRPO with SDE noise on 2 of the first 4 steps (ODE elsewhere): the early steps decide which digit
    appears, so their noise carries the credit. Groups of 16 (160 images an epoch); bench/RESULTS.md."""
    from trainer.rollout import SamplerSettings

    return _algorithms()["grpo"](group_size=16, sampler=SamplerSettings(sde_window=2, window_range=(0, 3)))


@dataclass
class DataConfig:
    """Where prompts (for rollouts) and supervised examples (for warm-up) come from."""

    name: str = "digits"
    """Registered task/dataset name (``trainer.data.DATASETS``): digits, words, prompt_file, inpaint_jsonl,
    edit_jsonl, triplet_folder."""
    path: LocalPath = ""
    """File or folder of file-based tasks (prompt_file: .txt or GenEval-style .jsonl; inpaint_jsonl /
    edit_jsonl: .jsonl rows; triplet_folder: the folder holding self_bench.txt)."""
    prompts_per_epoch: PositiveInt = 10
    """Distinct prompts per RL epoch over all ranks; each is sampled ``algorithm.group_size`` times."""
    image_size: PositiveInt = 16
    """Side images are resized to (digits: a multiple of 8; image datasets: must equal model.resolution)."""
    style_crop: Annotated[float, Bounds(0, 1, low_open=True)] = 0.5
    """Triplet folder: side fraction of the reference kept as the IP-Adapter style image (a centred crop,
    resized to data.image_size)."""
    image_inputs: list[str] = field(default_factory=list)
    """Image inputs given to the model (image, mask, reference, style, last_image); empty: all the format provides.
    Adapters reject inputs they do not use (e.g. text-to-image with an IP-Adapter takes only style)."""
    misnamed_share: Probability = 0.0
    """Moving digits: the share of the warm-up's clips, from step ``misnamed_from`` on, captioned with another
    direction than the clip's: a warm-up fitted to them follows every named direction in part, all four alike (at most
    1 - share of the time), which gives RL every direction to sharpen."""
    misnamed_from: NonNegativeInt = 0
    """The warm-up step from which ``misnamed_share`` applies (earlier steps' captions are all right)."""

    def __post_init__(self):
        from trainer.data import DATASETS

        if self.name not in DATASETS:
            raise ValueError(
                f"data.name={self.name!r} is not registered; choose one of: {', '.join(sorted(DATASETS))}"
                + did_you_mean(self.name, DATASETS)
            )
        if self.misnamed_share and self.name != "moving_digits":
            raise ValueError(
                f"data.misnamed_share={self.misnamed_share} is read by data.name='moving_digits' only (the "
                f"embedded video task), not {self.name!r}; remove it"
            )


@dataclass
class RewardConfig:
    """How the trainer reaches the reward pool."""

    urls: list[str] = field(default_factory=list)
    """Replica base URLs (http://host:port). Empty: the job starts ``replicas`` local servers itself."""
    weights: dict[str, FiniteFloat] = field(default_factory=lambda: {"digit": 1.0})
    """Scorer name -> weight; the combined reward is the weighted sum; each component is logged."""
    replicas: PositiveInt = 2
    """Local replicas started when ``urls`` is empty."""
    model_dir: LocalPath = ""
    """The folder the job's own replicas (``urls`` empty) load model-based scorers from, as a reward server's
    ``--model-dir`` (aesthetic/, pickscore/, hpsv2/, ...; docs/reward_protocol.md); empty: none, so only
    scorers without weights (digit, brightness, ocr, ...) run locally."""
    token: str | None = None
    """Bearer token sent to the servers, if they require one; None: $REWARD_SERVER_TOKEN (the servers' own
    variable), which keeps it off command lines. Never written to a run's config.yaml or checkpoints."""
    timeout_s: PositiveFloat = 60.0
    """Per-attempt HTTP timeout."""
    max_concurrency: PositiveInt = 8
    """In-flight requests at most, over all replicas."""
    batch_size: PositiveInt = 32
    """Items per /score request."""
    wire_format: Literal["msgpack", "msgpack+zstd", "msgpack+lz4", "png", "raw"] = "msgpack"
    """Image encoding on the wire: raw pixels in msgpack (lossless, cheap to encode), the same compressed
    for slow networks, or JSON with PNG / raw base64 (for debugging)."""
    max_failed_share: Probability = 0.5
    """An epoch stops the run, with a checkpoint of the epochs before it, when more than this share of its
    samples has no reward (failed scores are NaN, get advantage 0 and are counted; past this share the update
    would be biased)."""
    outage_s: NonNegativeFloat = 600.0
    """When every replica is out of rotation (stopped, restarting, loading its models), how long a request
    waits for one to come back before its samples count as unscored (NaN); 0: no waiting."""
    combine_mode: Literal["sum", "sum-then-normalise", "normalise-then-sum"] = "sum"
    """How weighted components become one reward; the normalising modes standardise over the batch."""

    def __post_init__(self):
        check_weights(self.weights)
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"urls: {url!r} has no scheme: write http://{url.split('://')[-1]}")
        if self.model_dir and self.urls:
            raise ValueError(
                f"reward.model_dir={self.model_dir!r} is for the job's own replicas, but reward.urls "
                "names servers: start those with --model-dir instead, or leave reward.urls empty"
            )
        if self.model_dir and not os.path.isdir(self.model_dir):
            raise ValueError(f"reward.model_dir={self.model_dir!r}: no such folder")


@dataclass
class ParallelConfig:
    """How training is distributed (torchrun sets the world; this picks the engine)."""

    backend: Literal["auto", "single", "ddp", "fsdp2", "zero2", "zero3"] = "auto"
    """auto: DDP under torchrun with more than one process, else a single process. ddp replicates the
    model on every rank; fsdp2 (FSDP2) and zero3 (DeepSpeed) shard weights, gradients and optimizer state
    (for models whose training state does not fit one device); zero2 shards gradients and optimizer state."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto picks nccl on CUDA, gloo on the CPU."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Mixed precision (fsdp2, zero2, zero3): the dtype forwards and backwards compute in, while the
    optimizer keeps float32 master weights (fsdp2: the float32 shards of a model.dtype=float32 model).
    DeepSpeed needs model.dtype to match. float16 losses are scaled (fsdp2: ShardedGradScaler; DeepSpeed:
    its own dynamic loss scale)."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Mixed precision (fsdp2, zero2, zero3): the dtype gradients are reduced in; float32 keeps the sum
    exact at twice the traffic of bfloat16."""
    cpu_offload: bool = False
    """fsdp2: keep sharded parameters, gradients and optimizer state in CPU memory; zero2/zero3: the
    optimizer state (and zero3 the parameters). Fits larger models at the cost of PCIe traffic."""
    gather_for_sampling: bool | None = None
    """fsdp2 and zero3: hold the gathered parameters through a rollout or an evaluation (fsdp2: each block
    from its first forward; zero3: all when sampling starts), so T steps gather them once rather than T times,
    at the full weights' memory. False: gather in every forward (weights too big for one device). Unset: on,
    except with cpu_offload, whose point is not to hold the full weights on the device."""
    sequence_parallel: PositiveInt = 1
    """Ranks that split each sample's tokens (Ulysses attention over heads; ddp and fsdp2, denoisers whose diffusers
    class has a context-parallel plan: Wan, Flux, Flux.2, Qwen-Image): a long video's activations divide over
    them. The world forms replicas of this many consecutive ranks, each one data-parallel replica. 1: off."""
    deepspeed_config: LocalPath = ""
    """A DeepSpeed JSON config to use instead of the packaged trainer/distributed/deepspeed_configs/zero{2,3}.json
    (linked from deploy/deepspeed/); its "auto" values are filled from this config (clipping, dtypes, offload),
    explicit values are kept."""


@dataclass
class TrainConfig:
    """The schedule and the optimizer."""

    seed: Seed = 0
    """Base seed; each rank derives its own streams from it."""
    warmup_steps: NonNegativeInt = 600
    """Supervised steps before RL (0 skips the warm-up)."""
    epochs: NonNegativeInt = 20
    """RL epochs (rollout, reward, update); 0 runs only the warm-up."""
    learning_rate: NonNegativeFloat = 3e-4
    """AdamW learning rate in the RL phase."""
    warmup_learning_rate: NonNegativeFloat = 1e-3
    """AdamW learning rate in the supervised warm-up."""
    weight_decay: NonNegativeFloat = 1e-4
    """AdamW weight decay."""
    adam_betas: tuple[Decay, Decay] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: NonNegativeFloat = 1.0
    """Gradient clipping by global norm; 0 disables clipping."""
    max_skipped_steps: PositiveInt = 20
    """An optimizer step whose gradients are not finite (inf or NaN) is skipped, on every rank alike, and counted
    (``skipped_steps``); this many in a row stop the run: it diverged. fp16's loss scaling skips a few steps
    while it finds its scale."""
    checkpoint_every: NonNegativeInt = 5
    """Write a checkpoint every N RL epochs (and at the end); 0 writes only the final one."""
    warmup_checkpoint_every: NonNegativeInt = 200
    """Write a checkpoint every N warm-up steps (0: none during the warm-up)."""
    keep_checkpoints: NonNegativeInt = 2
    """Complete checkpoints kept (older ones are deleted once a newer one is complete); 0 keeps all."""
    resume: str = ""
    """"auto": continue from the newest complete checkpoint of this run (logging.run_name; unset: the unfinished
    run in logging.output_dir with the newest checkpoint), a checkpoint directory, or "" to start fresh."""
    rollout_chunks: NonNegativeInt = 0
    """Chunks each epoch's rollout is sampled in (cut at whole reward requests, ``reward.batch_size``); a
    chunk's rewards are scored while the next one samples, so an epoch takes about max(S, R) + min(S, R) /
    chunks for sampling time S and scoring time R, rather than S + R. More chunks hide more but sample in
    smaller batches (bench/overlap.py). 0: up to 10 chunks of at least 8 images (``rollout.rollout_bounds``):
    at most about 1.1 max(S, R)."""
    device: str = "auto"
    """auto: cuda:<local rank> when CUDA is available, else cpu."""
    num_threads: NonNegativeInt = 0
    """torch CPU threads per process; 0 divides the machine's cores among local ranks."""
    ema_decay: Decay = 0.9
    """Decay of an EMA of the trainable weights during RL (e.g. 0.9-0.999; 0 keeps none), which evaluation
    reads (eval.use_ema): it smooths GRPO/PPO's late overshoot. Costs a float32 copy of this rank's trainable
    weights (small with LoRA, 4 bytes per parameter with full fine-tuning)."""
    ema_every: PositiveInt = 1
    """Update the EMA every N RL optimizer steps."""
    init_from: LocalPath = ""
    """A checkpoint directory whose trainable weights the run starts from (its optimizer and progress are
    not taken): e.g. RL with several algorithms from one warm-up run. Ignored when resuming."""
    select_by: str = ""
    """The evaluation metric (maximised) whose best evaluation keeps its weights, EMA included, in <run>/best/:
    "" is the task's own metric where it has one (digits: digit_accuracy), else reward_mean (the reward on
    the held-out samples); alarm/<scorer> names an eval.alarm_scorers one."""
    early_stop: NonNegativeInt = 0
    """Stop after this many evaluations (eval.every) without a new best train.select_by; 0: never."""
    warmup_after_init: bool = False
    """Run the supervised warm-up after ``init_from`` too; by default its weights are taken as warmed up."""

    @classmethod
    def migrate(cls, raw: dict) -> dict:
        """``train.select_by=guard/<scorer>`` (before 2026-12) is read as ``alarm/<scorer>``, with a warning."""
        select_by = raw.get("select_by")
        if not (isinstance(select_by, str) and select_by.startswith("guard/")):
            return raw
        new = "alarm/" + select_by.removeprefix("guard/")
        logger.warning("warning: train.select_by=%s is deprecated and read as %s: rename it so", select_by, new)
        return {**raw, "select_by": new}


@dataclass
class EvalConfig:
    """Fixed-seed evaluation before and after training (and every ``every`` epochs), on prompts RL does not
    sample where the task has others to train on, with alarm metrics beside the reward (trainer/scoreboard.py)."""

    path: LocalPath = ""
    """A file (or folder) of evaluation items in data.name's format, e.g. a test split of prompts; RL then samples
    every item of data.path. Empty: the evaluation holds data.path's first items out of RL."""
    allow_overlap: bool = False
    """Run although data.path shares items with eval.path (a prompt; with image inputs, a prompt on the same files):
    the run then prints how many, and its saved config says so. Off: such a run stops before any model loads,
    naming them (an evaluation on examples RL trains on measures memorisation)."""
    prompts: NonNegativeInt = 0
    """How many items are evaluated: the first N of eval.path, else of data.path (held out); 0: every item of
    eval.path, else data.path's first 8, or an embedded task's own set (digits: one prompt per digit)."""
    samples_per_prompt: PositiveInt = 10
    """Images per evaluation prompt; the grids show one row per prompt (the first 16 prompts)."""
    batch_size: PositiveInt = 1
    """Prompts sampled per forward (each with samples_per_prompt images): more keep a GPU busy on a test split of
    one sample per prompt. Each prompt keeps its own noise: its images are those of batch 1 up to float
    round-off (batched kernels), so keep it fixed across the runs you compare."""
    num_steps: PositiveInt = 10
    """Deterministic (ODE) steps for evaluation samples."""
    guidance_scale: NonNegativeFloat = 1.0
    """CFG scale for evaluation samples."""
    seed: Seed = 1234
    """Seed of the evaluation noise: the same images before and after, so they are comparable."""
    every: NonNegativeInt = 2
    """Evaluate every N RL epochs (0: only before and after); each evaluation may become train.select_by's best."""
    use_ema: bool = True
    """Evaluate with the EMA weights when ``train.ema_decay`` keeps an EMA."""
    breakdown: str = "tag"
    """A field of the evaluation items' records by whose values each scorer's mean is also logged, as
    by_<field>/<scorer>/<value>, with the unweighted mean over the values as by_<field>/<scorer>/mean: for
    GenEval's ``tag`` (counting, colors, position, ...) that mean is GenEval's overall score, and train.select_by
    may name it. Items without the field are left out of it; empty: no breakdown."""
    alarm_scorers: list[str] = field(default_factory=list)
    """Served scorers also scored on the evaluation's samples, logged as alarm/<name> beside the reward (e.g.
    aesthetic next to a PickScore reward): independent checks for the hacking alarm and train.select_by."""
    alarm_window: PositiveInt = 2
    """The reward-hacking alarm compares each evaluation with the one this many evaluations before it."""
    alarm_margin: NonNegativeFloat = 0.1
    """The alarm fires when the held-out reward rose over the window while an alarm metric (the task's own,
    alarm/<scorer>) fell by more than this."""
    on_alarm: Literal["warn", "stop", "rollback"] = "warn"
    """What an alarm does besides being printed and logged: nothing more, stop the run, or restore the best
    weights (and EMA, with fresh optimizer moments) and go on."""

    @classmethod
    def migrate(cls, raw: dict) -> dict:
        """``eval.guard_scorers`` (before 2026-12) is read as ``eval.alarm_scorers``, with a warning."""
        return renamed(raw, "eval", "guard_scorers", "alarm_scorers", [])


@dataclass
class LoggingConfig:
    """Where results go."""

    output_dir: str = "outputs"
    """Runs are written to <output_dir>/<run_name>/."""
    run_name: str = ""
    """Empty: a timestamp."""
    tensorboard: bool = True
    """Write a TensorBoard event log."""
    progress: bool = True
    """Show progress (rank 0): bars when stderr is a terminal, else lines every ``progress_every_s``."""
    progress_every_s: NonNegativeFloat = 60.0
    """Without a terminal (output to a file: nohup, SLURM), a progress line whenever nothing was printed for this
    many seconds in the warm-up or RL: steps or epochs done of all, what the run is at (a rollout chunk, the
    updates, an evaluation), the last loss or reward, the rate and the time left; 0: none."""
    rollout_samples: NonNegativeInt = 8
    """Rollout images shown per logged RL epoch (rank 0's first, with their prompts and rewards): in
    <run>/rollouts/epochNNNN.jpg and .jsonl, TensorBoard and W&B; 0: none. What RL really samples, beside the
    evaluation's fixed prompts (8 images at 512 px: 0.4 MB of JPEG, 0.3 s of one slow CPU core; bench/outputs.py)."""
    rollout_samples_every: PositiveInt = 1
    """Log rollout samples every this many RL epochs (and in the last)."""
    wandb: Literal["none", "online", "offline"] = "none"
    """Also log to Weights & Biases (``pip install -e ".[wandb]"``): online (``wandb login`` first) or offline
    (``wandb sync <run>/wandb/offline-run-*`` uploads it later). A resumed run continues its W&B run."""
    wandb_project: str = ""
    """The W&B project the run is logged in (its run name: the run directory's); empty: $WANDB_PROJECT, else
    rewardflow."""
    wandb_entity: str = ""
    """W&B team or user; empty: $WANDB_ENTITY, else your default entity."""

    def __post_init__(self):
        import importlib.util

        if self.run_name in (".", "..") or any(sep in self.run_name for sep in ("/", os.sep)):
            raise ValueError(
                f"logging.run_name={self.run_name!r} must be a plain folder name (runs go in "
                "logging.output_dir): set logging.output_dir for another place"
            )
        if self.wandb != "none" and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                f'logging.wandb={self.wandb} needs the wandb package: pip install -c constraints.txt -e ".[wandb]"'
            )


@dataclass
class Config:
    """Everything a run needs. Sections: model, algorithm, warmup, data, reward, parallel, train, eval, logging."""

    model: Annotated[Any, Selected(_models, "tiny")] = field(default_factory=_default_model)
    """The model family (``name``: tiny, sd3, ...) and its settings."""
    algorithm: Annotated[Any, Selected(_algorithms, "grpo")] = field(default_factory=_default_algorithm)
    """The RL algorithm (``name``: grpo, ...) and its settings."""
    warmup: SFTConfig = field(default_factory=SFTConfig)
    """The supervised warm-up objective (runs ``train.warmup_steps`` steps)."""
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        compile_mode = getattr(self.model, "compile", "none")
        if compile_mode != "none" and self.parallel.backend == "zero3":
            raise ValueError(
                f"model.compile={compile_mode} does not compose with parallel.backend=zero3: DeepSpeed "
                "gathers ZeRO-3 weights in a hook on every layer, which splits each compiled block into "
                "per-layer graphs (no fusion; graphs, recompiles and compile time multiply); use "
                "parallel.backend=fsdp2 (whole blocks sharded, each one graph) or zero2, or "
                "model.compile=none"
            )
        if self.parallel.sequence_parallel > 1 and getattr(self.model, "ip_adapter", None):
            raise ValueError(
                f"parallel.sequence_parallel={self.parallel.sequence_parallel} does not compose with model.ip_adapter: "
                "its attention processors attend over one rank's tokens; unset one of them"
            )
        scorer = getattr(self.algorithm, "scorer", None)  # a differentiable-reward algorithm's in-process scorer
        if scorer is not None and scorer not in self.reward.weights:
            raise ValueError(
                f"algorithm.scorer={scorer} is not served: add it to reward.weights (the served scores are logged, "
                "judged and watched by the alarm), or set algorithm.scorer to one of them"
            )
        if self.data.misnamed_share and 0 < self.train.warmup_steps <= self.data.misnamed_from:
            raise ValueError(
                f"data.misnamed_from={self.data.misnamed_from} is not before the warm-up's end "
                f"(train.warmup_steps={self.train.warmup_steps}), so no caption would be misnamed: lower "
                "data.misnamed_from, or remove data.misnamed_share"
            )
        if self.train.early_stop and not self.eval.every:
            raise ValueError(
                f"train.early_stop={self.train.early_stop} counts evaluations, but eval.every=0 runs none "
                "during RL: set eval.every, or train.early_stop=0"
            )


def reward_token(config: RewardConfig) -> str | None:
    """The bearer token the servers expect: ``reward.token``, else $REWARD_SERVER_TOKEN (None if neither)."""
    return config.token or os.environ.get("REWARD_SERVER_TOKEN") or None
