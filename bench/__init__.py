"""Scale benchmarks and simulators (docs/scale.md). Not installed with the library; run from a
checkout, e.g. ``python -m bench.scale``. Each module prints a table and writes its records as JSON."""
