"""kpool-pd as vLLM's KV connector: ``kv_connector_module_path`` "kpool_pd.vllm", ``kv_connector``
"KpoolPdConnector"; and, for a consumer's ``vllm serve``, ``--middleware kpool_pd.vllm.KvTransferParamsGuard``
(HTTP 400 for bad ``kv_transfer_params``). The only package that imports vllm (the ``vllm`` extra)."""

from kpool_pd.vllm.connector import KpoolPdConnector
from kpool_pd.vllm.guard import KvTransferParamsGuard

__all__ = ["KpoolPdConnector", "KvTransferParamsGuard"]
