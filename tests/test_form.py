"""The train-run form as the Prefect UI draws it: the parameter schema Prefect itself builds from
the flow's signature (the one `deploy` registers). Readable where an outside user found it was not:
a union's default branch said "is a const and cannot be changed", and a nested required field had
the same label as a top-level one."""

from __future__ import annotations

import json

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import ValidationError

from flows.params import TrainParams
from flows.train import train_run


@pytest.fixture(scope="module")
def schema() -> dict:
    return parameter_schema(train_run.fn).model_dump()


def _properties(schema: dict) -> dict[str, dict]:
    return {f"{name}.{key}": prop for name, d in schema["definitions"].items()
            for key, prop in d.get("properties", {}).items()}


def test_no_field_of_the_form_is_a_const(schema):
    consts = [path for path, prop in _properties(schema).items() if '"const"' in json.dumps(prop)]
    assert consts == []


def test_every_branch_of_a_union_that_is_not_just_optional_is_named(schema):
    for path, prop in _properties(schema).items():
        branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
        if len(branches) > 1:
            assert all(b.get("title") for b in branches), (path, branches)


def test_shard_checkpoint_every_offers_auto_first_then_steps(schema):
    every = schema["definitions"]["TrainParams"]["properties"]["shard_checkpoint_every"]
    assert every["default"] == "auto" and every["anyOf"][0]["enum"] == ["auto"]
    assert every["anyOf"][1]["type"] == "integer" and every["anyOf"][1]["minimum"] == 0
    for value in ("auto", 0, 25):  # what the form sends, the model takes
        assert TrainParams(shard_checkpoint_every=value).shard_checkpoint_every == value
    for bad in ("sometimes", -1):
        with pytest.raises(ValidationError):
            TrainParams(shard_checkpoint_every=bad)


def test_the_source_run_of_start_from_is_labelled_apart_from_the_runs_own_id(schema):
    titles = {path: prop.get("title") for path, prop in _properties(schema).items()}
    assert titles["StartFrom.run_id"] != titles["TrainParams.run_id"]
