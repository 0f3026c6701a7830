"""Distributed checkpoints through torch.distributed.checkpoint (DCP): save and load the model
and optimizer state of any plan, reshard between plans, import and export plain state dicts.

The public face of the runtime's checkpoints (autopar/checkpoint_api.py and the tests import
from here); the work is done in

    checkpoint_entries.py   what a rank holds, as entries (key, piece, global shape, cuts), and
                            the DTensors through which DCP reshards between plans
    checkpoint_save.py      save_checkpoint (atomic, optionally asynchronous), SaveHandle,
                            wait_pending; the manifest's optimizer part
    checkpoint_load.py      load_checkpoint under any plan, read_full_state_dict, import_state
    checkpoint_files.py     the on-disk side: manifest, hashes, verification, the allow-list
                            metadata reader, plain state dict files

Limits: element-wise optimizer state only (a state tensor shaped neither like its parameter
nor scalar is refused with a ValueError); expert and context parallel axes are not mapped
yet (they are absent from the runtime too).

It reads and writes no `node.meta` keys; it imports nothing above runtime/ (layouts, shapes
and aliases come in as plain data).
"""
from __future__ import annotations

from .checkpoint_entries import engines_of, local_chunk
from .checkpoint_files import (CheckpointError, SafeFileSystemReader, StateSource, agree, latest_checkpoint,
                               list_checkpoints, read_manifest, read_metadata, verify_checkpoint, write_state_dict)
from .checkpoint_load import import_state, load_checkpoint, read_full_state_dict
from .checkpoint_save import CheckpointSaveError, SaveHandle, clean_staging, save_checkpoint, settle_pending, wait_pending

__all__ = ["save_checkpoint", "load_checkpoint", "SaveHandle", "wait_pending", "CheckpointSaveError", "clean_staging",
           "settle_pending", "read_full_state_dict",
           "import_state", "local_chunk", "engines_of", "CheckpointError", "SafeFileSystemReader", "StateSource",
           "agree", "latest_checkpoint", "list_checkpoints", "read_manifest", "read_metadata", "verify_checkpoint",
           "write_state_dict"]
