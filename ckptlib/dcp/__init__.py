"""ckptlib as a storage backend of ``torch.distributed.checkpoint`` (DCP): docs/integrations.md.

    import torch.distributed.checkpoint as dcp
    from ckptlib.dcp import StorageReader, StorageWriter
    writer = StorageWriter("s3://bucket/run-1")               # one per rank, kept for the run
    dcp.save(state, storage_writer=writer, checkpoint_id=step)  # a ckptlib step: ckpt ls/verify/gc see it
    dcp.load(state, storage_reader=StorageReader("s3://bucket/run-1"))  # the latest committed step

Imports torch (DCP is torch's); ``import ckptlib`` alone does not load this.
"""

from .metadata import Location
from .reader import StorageReader
from .writer import METADATA_PART, StorageWriter, rank_part

__all__ = ["METADATA_PART", "Location", "StorageReader", "StorageWriter", "rank_part"]
