"""atom: a lightweight, fast LLM inference engine."""

from atom.engine.llm_engine import LLMEngine
from atom.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLMEngine", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
