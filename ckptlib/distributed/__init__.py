"""ckptlib in torch.distributed jobs: collective saves of DDP, FSDP2 and DTensor states, one commit
across ranks, restores onto any layout (docs/distributed.md).

Modules, one idea each: ``documents`` (the rank and group fragments), ``pieces`` (geometry of boxes
of a global tensor), ``local`` (a rank's state as local leaves), ``plan`` (who stores what: values
identical on every rank stored once), ``group`` (a group's part checked together), ``collective``
(the checkpointer's own gloo group), ``saving`` and ``restoring``. ``Checkpointer(process_group=...)``
is the public face; importing this package loads neither torch nor torch.distributed.
"""
