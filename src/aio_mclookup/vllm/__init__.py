"""aio-mclookup inside vLLM: ``MooncakeStoreConnector``, whose scheduler lookups coalesce.

Load it with ``kv_connector_module_path="aio_mclookup.vllm"`` (docs/vllm.md). Importable only
where vLLM (0.32 or 0.33) is installed: from a clone, ``pip install -e '.[vllm]'`` beside it.
"""

try:
    import vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "aio_mclookup.vllm needs vLLM (0.32 or 0.33) in the same environment"
    ) from exc

from .._scheduler.client import PLUGIN_DEFAULTS, CoalescingLookupClient
from ._connector import MooncakeStoreConnector

__all__ = ["PLUGIN_DEFAULTS", "CoalescingLookupClient", "MooncakeStoreConnector"]
