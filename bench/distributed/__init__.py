"""The distributed benchmark: ckptlib's collective Checkpointer against DCP on the same FSDP2 jobs.

``ckpt bench --distributed`` (``ckpt/cmd_bench.py``) calls ``run.run_distributed_benchmark`` and
``run.render``. Modules: ``job`` (one rank: train with FSDP2, save with both systems, restore both),
``run`` (start the ranks of each job, aggregate, the table). Method and figures: docs/distributed.md.
"""
