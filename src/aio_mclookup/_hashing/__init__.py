"""vLLM-exact block hashing: token ids -> ``request.block_hashes`` (vLLM 0.26.0 to 0.33.x).

Modules: ``_release`` (releases, eras, the seed), ``_algos`` (the four algorithms),
``_inputs`` (checking the caller's inputs), ``_extras`` (each block's extra keys),
``_payload`` (the serialised chain tuples of many blocks at once), ``_hasher`` (the chain).
"""

from __future__ import annotations

from ._hasher import BlockHasher
from ._inputs import MAX_BLOCK_SIZE, MAX_TOKENS

__all__ = ["MAX_BLOCK_SIZE", "MAX_TOKENS", "BlockHasher"]
