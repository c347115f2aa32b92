"""vLLM's own store connector, recording (``kv_connector_module_path="recording_stock"``)."""

from recording import recording
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector as _Stock,
)

MooncakeStoreConnector = recording(_Stock)
