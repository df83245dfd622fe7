"""The store's location and credentials from one Prefect block (``CheckpointStore``, ``store_block``).

On a real Prefect server (``prefect_harness``) and a real SeaweedFS with authentication: a train-run
flow run given only the block's name (as the deployment's form sends it) writes its checkpoints
where the block says, reaching it with the block's credentials (none in the environment), and the
secret is in no flow run's parameters, task run, log, artifact or event. A missing block, a block
of another type, a block beside other credentials and ``--store`` beside ``--store-block`` are one
clear error each, naming the block and the fix.
"""

from __future__ import annotations

import json

import pytest

from tests.prefect_records import api_text

pytestmark = [pytest.mark.prefect]

EXTRA = {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536}


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """A training run in this process sets torch's (process-wide) thread count: put it back."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_a_train_run_takes_its_store_and_credentials_from_the_block_and_no_record_holds_the_secret(
        prefect_harness, seaweedfs, s3_url, monkeypatch):
    from ckptlib import Checkpointer
    from flows.params import TrainParams
    from flows.train import train_run
    from tasks.store_block import CheckpointStore

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "CKPT_STORAGE_OPTIONS"):
        monkeypatch.delenv(var, raising=False)  # the block is the only way in
    secret = s3_url.storage_options["secret"]
    CheckpointStore(url=s3_url.url, storage_options=s3_url.storage_options).save("ckpt-test-store", overwrite=True)

    # what `ckpt train --store-block` builds: the block's URL, its options by reference only
    p = TrainParams(store_block="ckpt-test-store")
    assert (p.store, p.credentials_block) == (s3_url.url, "checkpoint-store/ckpt-test-store")
    assert secret not in p.model_dump_json() and secret not in json.dumps(p.public_dict())

    # a flow run given the block's name as a form sends it (a dict, validated in the flow's process)
    summary = train_run(params={"store_block": "ckpt-test-store", "run_id": "from-block", "workload_extra": EXTRA,
                                "shards": 1, "rounds": 1, "steps_per_round": 3, "heartbeat_every_s": 0.2,
                                "validation_runner": "threads"})
    assert summary["validated"] == [0, 1], summary
    with Checkpointer(f"{s3_url.url}/from-block", s3_url.storage_options) as ck:
        assert ck.steps() == [0, 1] and ck.latest_step(healthy=True) == 1

    for path in ("/flow_runs/filter", "/task_runs/filter", "/logs/filter", "/artifacts/filter", "/events/filter"):
        text = api_text(path)
        assert secret not in text, path
    assert "ckpt-test-store" in api_text("/flow_runs/filter")  # the runs name the block, nothing more


def test_a_missing_block_or_one_of_another_type_is_one_clear_error(prefect_harness):
    from prefect.blocks.system import Secret
    from pydantic import ValidationError

    from flows.params import TrainParams
    from flows.train import train_run

    with pytest.raises(ValidationError) as e:
        TrainParams(store_block="no-such-store")
    msg = str(e.value)
    assert "store block 'no-such-store' does not exist" in msg and "CheckpointStore(url=" in msg, msg
    assert msg.count("no-such-store") == 2, msg  # once in the cause, once in the fix: said once

    # a flow run (a deployment's form) fails its parameters with the same one line
    with pytest.raises(Exception, match="store block 'no-such-store' does not exist"):
        train_run(params={"store_block": "no-such-store"})

    Secret(value={"key": "k", "secret": "s"}).save("ckpt-test-a-secret", overwrite=True)
    with pytest.raises(ValidationError, match=r"store block 'ckpt-test-a-secret' is a 'secret' block, not a "
                                              r"'checkpoint-store'.*credentials_block"):
        TrainParams(store_block="ckpt-test-a-secret")
    with pytest.raises(ValidationError, match="leave credentials_block and storage_options empty"):
        TrainParams(store_block="ckpt-test-a-secret", credentials_block="ckpt-test-a-secret")
    with pytest.raises(ValidationError, match="not a block name"):
        TrainParams(store_block="checkpoint-store/x")


def test_ckpt_train_store_block_option(prefect_harness, tmp_path):
    from typer.testing import CliRunner

    from ckpt.cli import app
    from ckpt.train_options import TrainOptions
    from tasks.store_block import CheckpointStore

    CheckpointStore(url=str(tmp_path / "runs")).save("ckpt-test-local", overwrite=True)
    p = TrainOptions(store_block="ckpt-test-local").params("r1", {}, None)
    assert (p.store, p.credentials_block, p.store_block) == (str(tmp_path / "runs"), "checkpoint-store/ckpt-test-local",
                                                             "ckpt-test-local")
    r = CliRunner().invoke(app, ["train", "--store", "s3://b/p", "--store-block", "ckpt-test-local"])
    assert r.exit_code == 2 and "both name the store: give one" in r.output, r.output
