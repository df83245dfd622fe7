"""trainrun: the runtime of a training run, without Prefect.

A training run (docs/training.md) is rounds of data-parallel shards, each round ending in a cut the
coordinator commits with ckptlib; a watchdog fences shards that die silently and reruns them.
This package is all of that as plain Python: ``tasks/`` wraps its functions as Prefect tasks,
``flows/`` composes them, ``ckpt`` calls it. It imports ckptlib and workloads, never Prefect.

    layout       names and keys of a run in its store, run ids, finding runs
    spec         RunSpec (the trajectory) and RunSettings (everything else a run is told), Cut
    credentials  how a process reaches the store without a secret in any record
    beats        the run's heartbeats: the coordinator's beat and what each beat carries
    rounds       where a run starts, step 0, one shard's round
    outer        the outer step that combines the shards
    cut          the coordinator's cut of one round (gather, combine, commit)
    checks       the run's validation checks, plugged into ckptlib.validate
    chaos        fault injection for drills
    watchdog/    judge (the rules), decisions, reruns, the watchdog's state machine

docs/architecture.md shows how the packages depend on each other.
"""
