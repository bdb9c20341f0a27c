"""The reference cache filled at one world size, run by tests/test_reference_cache.py (under torchrun for world size
2, or as one process): every rank computes its share of the forwards and receives all; rank 0 writes the file.

usage: python reference_cache_world.py WORLD CACHE_DIR OUT.json

Writes, from rank 0, each sequence's cached log-probs (float64) and whether every rank held the same values.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from pair_references import fresh_model, make_pairs

from exactrl.distributed.collectives import gather
from exactrl.distributed.launch import end_rank, init_process_group, shutdown
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.reference_cache import ReferenceCache, sequence_key
from exactrl.workers.worker import Worker


def main(world: int, directory: str, out_path: str) -> None:
    init_process_group()
    assert dist.get_world_size() == world, (dist.get_world_size(), world)
    tok = build_tokenizer()
    samples = make_pairs(tok)
    reference = Worker("reference", fresh_model(tok, seed=9), pad_id=tok.pad_token_id)
    cache = ReferenceCache(directory, "world")
    computed = cache.fill(samples, lambda: reference, per_forward=3)
    mine = [cache.values[sequence_key(s.ids)].tolist() for s in samples]
    same = all(v == mine for v in gather(mine))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"computed": computed, "same_on_every_rank": same, "values": mine}, f)
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
