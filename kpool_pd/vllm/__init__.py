"""kpool-pd as vLLM's KV connector: ``kv_connector_module_path`` "kpool_pd.vllm", ``kv_connector``
"KpoolPdConnector". The only package that imports vllm (the ``vllm`` extra)."""

from kpool_pd.vllm.connector import KpoolPdConnector

__all__ = ["KpoolPdConnector"]
