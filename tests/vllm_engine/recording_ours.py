"""aio-mclookup's connector, recording (``kv_connector_module_path="recording_ours"``)."""

from recording import recording

from aio_mclookup.vllm import MooncakeStoreConnector as _Ours

MooncakeStoreConnector = recording(_Ours)
