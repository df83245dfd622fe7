"""``ckpt train``'s options as one typed object (``TrainOptions``), and the ``TrainParams`` they become.

Each field is one option: its type, its typer declaration (flag, help, panel of ``--help``) and its
default, written once. ``options_command`` makes a function of a ``TrainOptions`` a typer command
whose options are those fields, so the command's body reads ``o.shards``, not 27 parameters.

Most options are ``flows.params.TrainParams`` fields (the one schema: trajectory ``RunSpec``,
``RunSettings``, where the run lives; ``CLI_FIELDS`` maps them). Their defaults are written here too,
for ``--help``, so that starting ``ckpt`` does not import pydantic; a test checks every one against
the schema (tests/test_train_units.py). Bounds are the schema's: ``TrainParams`` validates.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from .common import STORAGE_OPTIONS_HELP

if TYPE_CHECKING:
    from flows.params import TrainParams

RUN, TRAJECTORY, WHERE, FAILURES, OUTPUT = ("The run", "Trajectory (fixed for the run's life)", "Where it runs",
                                            "Failures and the watchdog", "Output")


def _opt(*flags: str, panel: str, **kw: Any) -> Any:
    return typer.Option(*flags, rich_help_panel=panel, **kw)


@dataclass(frozen=True)
class TrainOptions:
    """Every option of ``ckpt train``, as given on the command line (not validated yet)."""

    store: Annotated[str, _opt("--store", metavar="URL", panel=RUN, help="Where runs live: a directory, "
                               "file:///abs/path or s3://bucket/prefix; checkpoints go to <store>/<run-id>.")] = "./runs"
    run_id: Annotated[Optional[str], _opt("--run-id", metavar="ID", panel=RUN,
                                          help="Run id (default: date + short uuid).")] = None
    workload: Annotated[str, _opt("--workload", metavar="NAME", panel=TRAJECTORY,
                                  help="tinylm, recsys, finetune, finetune-bf16, or package.module:factory.")] = "tinylm"
    size: Annotated[str, _opt("--size", panel=TRAJECTORY, help="Workload size preset: small | bench.")] = "small"
    workload_extra: Annotated[Optional[str], _opt("--workload-extra", metavar="JSON", panel=TRAJECTORY,
                                                  help="Workload knobs as a JSON object, e.g. '{\"d_model\": 64}'.")] = None
    batch_size: Annotated[Optional[int], _opt("--batch-size", panel=TRAJECTORY,
                                              help="Per-shard batch size (default: the workload's).")] = None
    lr: Annotated[Optional[float], _opt("--lr", panel=TRAJECTORY,
                                        help="Inner learning rate (default: the workload's).")] = None
    shards: Annotated[int, _opt("--shards", panel=TRAJECTORY, help="Data-parallel shards.")] = 2
    rounds: Annotated[int, _opt("--rounds", panel=RUN, help="Total rounds (a resume may extend the run).")] = 8
    steps_per_round: Annotated[int, _opt("--steps-per-round", panel=TRAJECTORY,
                                         help="Inner steps H per shard and round.")] = 150
    checkpoint_every: Annotated[int, _opt("--checkpoint-every", panel=RUN,
                                          help="Commit a checkpoint every C rounds (and after the last).")] = 1
    keyframe_every: Annotated[int, _opt("--keyframe-every", panel=RUN, help="At most K-1 deltas per chunk before a "
                                        "keyframe (chains also end once their deltas add up to twice a keyframe).")] = 32
    seed: Annotated[int, _opt("--seed", panel=TRAJECTORY, help="Run seed.")] = 0
    resume: Annotated[bool, _opt("--resume", panel=RUN,
                                 help="Continue the run --run-id from its last healthy checkpoint.")] = False
    task_runner: Annotated[str, _opt("--task-runner", metavar="RUNNER", panel=WHERE,
                                     help="Where shard tasks run: threads, dask, dask://HOST:PORT or "
                                          "pool:FLOW/DEPLOYMENT (docs/scale.md).")] = "threads"
    validation_runner: Annotated[str, _opt("--validation-runner", metavar="process|threads", panel=WHERE,
                                           help="Where validations run: process (one worker process beside "
                                                "training: no GIL contention) or threads (this process: no "
                                                "worker to start).")] = "process"
    storage_options: Annotated[Optional[str], _opt("--storage-options", metavar="@FILE|JSON", panel=WHERE,
                                                   help=STORAGE_OPTIONS_HELP)] = None
    credentials_block: Annotated[Optional[str], _opt("--credentials-block", metavar="NAME", panel=WHERE,
                                                     help="A Prefect Secret block holding the s3fs options "
                                                          "(instead of --storage-options).")] = None
    store_block: Annotated[Optional[str], _opt("--store-block", metavar="NAME", panel=WHERE,
                                               help="A Prefect Checkpoint Store block: the store's URL and its "
                                                    "s3fs options in one (instead of --store and credentials; "
                                                    "needs PREFECT_API_URL).")] = None
    chaos: Annotated[Optional[list[str]], _opt("--chaos", metavar="FAULT", panel=FAILURES,
                                               help="Inject a fault KIND:shard=I,round=R, optionally with ,step=K "
                                                    "and ,attempt=A; KIND: crash, hang, zombie, stall, kill, stop or "
                                                    "preempt (repeatable; kill and stop need --task-runner dask; see "
                                                    "docs/watchdog.md).")] = None
    outer_lr: Annotated[float, _opt("--outer-lr", panel=TRAJECTORY, help="Outer learning rate (1 = averaging).")] = 1.0
    outer_momentum: Annotated[float, _opt("--outer-momentum", panel=TRAJECTORY,
                                          help="Outer Nesterov momentum (0 = none).")] = 0.0
    torch_threads: Annotated[int, _opt("--torch-threads", panel=TRAJECTORY,
                                       help="torch threads per process (part of the config).")] = 1
    ranks_per_shard: Annotated[int, _opt("--ranks-per-shard", metavar="R", panel=TRAJECTORY,
                                         help="Rank processes per shard (a gloo group training with DDP; 1 = "
                                              "the task's own process).")] = 1
    parallelism: Annotated[str, _opt("--parallelism", metavar="ddp|fsdp", panel=TRAJECTORY,
                                     help="How a shard's ranks share it: ddp (replicas) or fsdp (FSDP2: each rank "
                                          "1/R of the parameters and optimizer state).")] = "ddp"
    no_validate: Annotated[bool, _opt("--no-validate", panel=RUN, help="Skip validation (then no checkpoint is "
                                      "healthy: resume restarts).")] = False
    json_out: Annotated[Optional[str], _opt("--json", metavar="PATH", panel=OUTPUT,
                                            help="Also write the summary as JSON to PATH.")] = None
    verbose: Annotated[bool, _opt("--verbose", "-v", panel=OUTPUT,
                                  help="Show Prefect's log lines instead of the live table.")] = False
    heartbeat_every: Annotated[float, _opt("--heartbeat-every", metavar="S", panel=FAILURES,
                                           help="Seconds between a shard's heartbeats.")] = 2.0
    shard_checkpoint_every: Annotated[str, _opt("--shard-checkpoint-every", metavar="N|auto", panel=FAILURES,
                                                help="Each shard checkpoints its own state every N steps of a round "
                                                     "(0: never; auto: at about 2% of its training time), so a "
                                                     "failed shard continues from there (docs/training.md).")] = "auto"
    no_local_tier: Annotated[bool, _opt("--no-local-tier", panel=FAILURES, help="Keep shard checkpoints in the "
                                        "store only, not also in this host's /dev/shm.")] = False
    preempt_grace: Annotated[float, _opt("--preempt-grace", metavar="S", panel=FAILURES,
                                         help="On SIGTERM (a preemption) or a cancel, each shard checkpoints "
                                              "where it is and stops; the process ends at the latest S seconds "
                                              "after the signal.")] = 30.0
    min_shards: Annotated[Optional[int], _opt("--min-shards", metavar="K", panel=FAILURES,
                                              help="Quorum mode: a round whose shard failed an attempt is cut with "
                                                   "the shards that finished it cleanly, if at least K did; the "
                                                   "failed shard rejoins next round (default: off, wait for every "
                                                   "shard's retries; docs/training.md).")] = None
    no_watchdog: Annotated[bool, _opt("--no-watchdog", panel=FAILURES, help="Run no watchdog beside the run (leave "
                                      "hung or dead shards to `ckpt watchdog` or the watchdog deployment).")] = False
    watchdog_timeout: Annotated[float, _opt("--watchdog-timeout", metavar="S", min=0.1, panel=FAILURES,
                                            help="The watchdog declares a shard dead after S seconds without a beat "
                                                 "or progress.")] = 30.0

    def params(self, run_id: str, workload_extra: dict[str, Any], storage_options: dict[str, Any] | None) -> TrainParams:
        """The flow's parameter (pydantic validates: ``ValidationError`` names each bad field); the
        options that need parsing first come parsed."""
        from flows.params import TrainParams
        from trainrun.credentials import StorageOptions

        given = {field: getattr(self, name) for name, field in CLI_FIELDS.items()}
        if self.store_block:  # the block holds the store: TrainParams takes its URL
            if self.store != "./runs":
                raise typer.BadParameter(f"--store {self.store} and --store-block {self.store_block} both name the "
                                         "store: give one (the block holds its URL)", param_hint="--store-block")
            del given["store"]
        return TrainParams(**{**given, "run_id": run_id, "workload_extra": workload_extra, "chaos": list(self.chaos or []),
                              "storage_options": StorageOptions(storage_options) if storage_options else None,
                              "validate_checkpoints": not self.no_validate, "local_tier": not self.no_local_tier})


def trajectory_fields(given: frozenset[str]) -> set[str]:
    """The trajectory (``RunSpec``) fields among the options ``given``."""
    from trainrun.spec import RunSpec

    return {CLI_FIELDS[o] for o in given if CLI_FIELDS.get(o) in RunSpec.model_fields}


# option -> TrainParams field, for every option that is one (the others: output, the watchdog, --no-validate)
CLI_FIELDS = {"store": "store", "run_id": "run_id", "workload": "workload", "size": "workload_size",
              "workload_extra": "workload_extra", "batch_size": "batch_size", "lr": "lr", "seed": "seed",
              "shards": "shards", "steps_per_round": "steps_per_round", "outer_lr": "outer_lr",
              "outer_momentum": "outer_momentum", "torch_threads": "torch_threads",
              "ranks_per_shard": "ranks_per_shard", "parallelism": "parallelism", "rounds": "rounds",
              "checkpoint_every": "checkpoint_every", "keyframe_every": "keyframe_every", "resume": "resume",
              "task_runner": "task_runner", "validation_runner": "validation_runner", "chaos": "chaos",
              "heartbeat_every": "heartbeat_every_s",
              "shard_checkpoint_every": "shard_checkpoint_every", "preempt_grace": "preempt_grace_s", "min_shards": "min_shards",
              "storage_options": "storage_options", "credentials_block": "credentials_block",
              "store_block": "store_block"}


def options_command(body: Callable[[TrainOptions, frozenset[str]], None]) -> Callable[..., None]:
    """``body`` as a function of keyword arguments, one per ``TrainOptions`` field, whose signature
    (what typer reads) is those fields' (name, typer annotation, default). ``body`` gets the options
    and the names of those typed on the command line (a resume checks them against the run and takes
    the run's own values for the others)."""
    hints = typing.get_type_hints(TrainOptions, include_extras=True)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                                default=inspect.Parameter.empty if f.default is MISSING else f.default)
              for f in fields(TrainOptions)]

    @functools.wraps(body)
    def command(ctx: typer.Context, **options: Any) -> None:
        # where each value came from (typer's click): DEFAULT unless it was typed (or set by the environment)
        sources = {name: ctx.get_parameter_source(name) for name in options}
        given = frozenset(name for name, src in sources.items() if src is not None and src.name != "DEFAULT")
        body(TrainOptions(**options), given)

    del command.__wrapped__  # typer reads the signature below, not the body's
    ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    params = [ctx_param, *params]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
