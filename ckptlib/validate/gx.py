"""Great Expectations: the suites built from ``Check``s, judging the tables, and Data Docs pages.

GX runs in an ephemeral context with in-memory stores and no Data Docs site (the pages are rendered
to strings and written through the Store by ``report``: GX itself writes no file), progress bars
off, result format COMPLETE with the ``part``/``tensor`` columns as unexpected-index columns, so
every failure names its rows. GX contexts share module state: every GX call of this process holds
``_GX_LOCK``. GX is imported lazily (about 2 s).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .checks import Check, Ref
from .thresholds import Thresholds

_GX_LOCK = threading.Lock()


def _suite(gx: Any, gxe: Any, table: str, checks: Sequence[Check], th: Thresholds, ref: Ref) -> Any:
    """The Expectation Suite of one table; each expectation carries its Check name in meta."""
    exps = []
    for c in checks:
        if c.table != table:
            continue
        common = {"column": c.column, "meta": {"name": c.name}, "description": f"{c.name}: {c.what}"}
        if c.in_set is not None:
            exps.append(gxe.ExpectColumnValuesToBeInSet(value_set=c.in_set(th, ref), **common))
        elif c.between is not None:
            lo, hi = c.between(th, ref)
            exps.append(gxe.ExpectColumnValuesToBeBetween(min_value=lo, max_value=hi, **common))
        else:
            raise ValueError(f"check {c.name!r} says neither in_set nor between: give it one")
    return gx.ExpectationSuite(name=f"checkpoint_{table}", expectations=exps)


def run_gx(tables: Mapping[str, Any], checks: Sequence[Check], th: Thresholds, ref: Ref,
           run_name: str) -> dict[str, Any]:
    """Validate each DataFrame with its suite; ``{table: ExpectationSuiteValidationResult}``."""
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    results = {}
    with _GX_LOCK:
        config = DataContextConfig(store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False))
        ctx = gx.get_context(mode="ephemeral", project_config=config)
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
        source = ctx.data_sources.add_pandas("checkpoint")
        for table, df in tables.items():
            batch = source.add_dataframe_asset(table).add_batch_definition_whole_dataframe("all")
            suite = ctx.suites.add(_suite(gx, gxe, table, checks, th, ref))
            vd = ctx.validation_definitions.add(gx.ValidationDefinition(name=f"{table}-{run_name}", data=batch,
                                                                        suite=suite))
            index = ["part", "tensor"] if table == "tensors" else ["part"]
            results[table] = vd.run(batch_parameters={"dataframe": df}, result_format={
                "result_format": "COMPLETE", "unexpected_index_column_names": index,
                "partial_unexpected_count": 20})
    return results


def render_gx_html(result: Any) -> str:
    """One self-contained GX Data Docs page for a validation result."""
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    with _GX_LOCK:
        return DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(result))
