"""The checkpoint benchmark: ckptlib against torch.save, DCP, DCP async and a plain memcpy, side by
side, on the states of real training; and ckptlib on S3 against torch.save + upload.

Who calls what
--------------
``ckpt bench`` (``ckpt/cmd_bench.py``) builds a ``config.BenchConfig`` and calls
``measure.run_benchmark``, then ``report.render_table`` and ``report.check_targets``;
``ckpt bench --s3 --s3-state resnet`` calls ``s3.run_s3_benchmark`` and ``s3.render_s3`` (plain
``--s3``: ``bench/s3_ceiling.py``). Everything here is
importable and has no CLI. The method and the figures: docs/benchmark.md.

Modules, one idea each
----------------------
* ``config``: what a run measures (``BenchConfig``: workloads, saves, systems, device).
* ``series``: the states every system saves (a workload trained for real, copied every few steps).
* ``contenders``: the systems under test, one ``Runner`` each (ckptlib, torch.save, dcp, dcp_async,
  memcpy).
* ``probes``: peak and current RSS, bytes on disk, freeing the heap and the page cache.
* ``measure``: one run (save the series with each system, restore the latest, check it bit for
  bit, one record per system).
* ``entropy``: the order-0 entropy bound of a dense state.
* ``report``: ratios, the table, the targets.
* ``trees``: walking a state's dicts, lists and tuples.
* ``resnet``, ``s3``: the S3 benchmark's state and its run.
"""
