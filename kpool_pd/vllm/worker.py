"""The worker side of the connector (the process that holds vLLM's KV tensors): a producer serves
PrefillService from vLLM's blocks (``kpool_pd.vllm.producer_worker``), a consumer pulls into them
(``kpool_pd.vllm.consumer_worker``).

The project's connector runs on an event loop in a thread of its own (``kpool_pd.vllm.loop.ConnectorLoop``);
vLLM's worker calls in from its thread and hands work over, and its idle steps wait for the transfers in
flight (``kpool_pd.vllm.loop.TransferProgress``).
"""

from kpool_pd.vllm.consumer_worker import ConsumerWorker, ProducerRefused
from kpool_pd.vllm.loop import ConnectorLoop, TransferProgress, connector_config, rank_address
from kpool_pd.vllm.producer_worker import NoPrefillCalls, ProducerWorker

__all__ = ["ConnectorLoop", "ConsumerWorker", "NoPrefillCalls", "ProducerRefused", "ProducerWorker",
           "TransferProgress", "connector_config", "rank_address"]
