"""trainrun: the runtime of a training run, without Prefect.

A training run (docs/training.md) is rounds of data-parallel shards, each round ending in a cut the
coordinator commits with ckptlib; a watchdog fences shards that die silently and reruns them.
This package is all of that as plain Python: ``tasks/`` wraps its functions as Prefect tasks,
``flows/`` composes them, ``ckpt`` calls it. It imports ckptlib and workloads, never Prefect.

    layout       names and keys of a run in its store, run ids, finding runs
    spec         RunSpec (the trajectory) and RunSettings (everything else a run is told)
    documents    what the run's processes exchange: Cut, ShardInfo, CoordinatorInfo (a beat's meta)
    errors       RunRefused, RerunRefused, ChaosCrash, Preempted (ckptlib's CheckpointError tree)
    credentials  how a process reaches the store without a secret in any record
    resume       where a run starts: the resume rules (RunRefused)
    step_zero    the first checkpoint: every shard's fresh state and the coordinator's
    failures     the failures vocabulary: what failed, how it was seen, what is decided
    attempt      one attempt at a shard's round, whoever hosts it: start, build, train with beats, write
    shard_round  one shard's round hosted in this process (rank_round: as a rank of a group)
    outer        the outer step that combines the shards
    reshard      a cut of another shard count: which old shards a new one starts from
    cut          the coordinator's cut of one round (gather, combine, commit)
    beats        the coordinator's heartbeat thread
    timing       where a task's time went (the results' seconds)
    checks       the run's validation checks, plugged into ckptlib.validate
    chaos        fault injection for drills
    watchdog/    judge (the rules), decisions, reruns, the watchdog's state machine

Reading a run (the watchdog, ``ckpt status``) loads no torch: ``documents``, ``resume`` and
``watchdog/`` import none; the modules that train (``attempt``, ``shard_round``, ``step_zero``, ``cut``) do.

docs/architecture.md shows how the packages depend on each other.
"""
