"""Benchmarks. ``bench.checkpoint``: the checkpoint benchmark behind ``ckpt bench`` (docs/benchmark.md).
The scale benchmarks and simulators (docs/scale.md) run as modules, e.g. ``python -m bench.scale``;
each prints a table and writes its records as JSON. Installed with the project (``make .venv``), so
``ckpt bench`` works from any directory."""
