"""The deterministic synthetic model both workers run (weights from a seed), its batch engine,
and the colocated runner that every PD run must match."""

from kpool_pd.model.config import ModelConfig, default_block_size
from kpool_pd.model.engine import DecodeSequence, Engine, PrefillJob, output_digest
from kpool_pd.model.prompt import check_mrope_positions, check_prompt, mrope_delta, mrope_from_flat
from kpool_pd.model.weights import SyntheticWeights

__all__ = ["DecodeSequence", "Engine", "ModelConfig", "PrefillJob", "SyntheticWeights", "check_mrope_positions",
           "check_prompt", "default_block_size", "mrope_delta", "mrope_from_flat", "output_digest"]
