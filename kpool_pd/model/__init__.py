"""The deterministic synthetic model both workers run (weights from a seed), its batch engine,
and the colocated runner that every PD run must match."""

from kpool_pd.model.config import ModelConfig, default_block_size
from kpool_pd.model.engine import DecodeSequence, Engine, PrefillJob, output_digest
from kpool_pd.model.prompt import check_prompt
from kpool_pd.model.weights import SyntheticWeights

__all__ = ["DecodeSequence", "Engine", "ModelConfig", "PrefillJob", "SyntheticWeights", "check_prompt", "default_block_size",
           "output_digest"]
