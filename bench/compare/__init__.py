"""Recovery measured beside peers (``ckpt soak --compare``; docs/recovery.md).

The same model, data and seeds (the tinylm workload, one shard of batches per rank), the same
total steps and the same failures, through two other systems:

- ``torchrun_dcp``: torchrun (``--max-restarts``) over gloo, DCP checkpoints every N steps;
- ``torchft_peer``: torchft replica groups of one process each, DDP over gloo, its lighthouse,
  a restarted replica healed from the live one.

``schedule`` maps ``ckpt soak``'s failure specs onto ranks and global steps, ``report`` turns
each run's event log into the figures, ``workload`` is the training step they share.
"""

PEERS = ("torchft", "torchrun-dcp")
