"""Decoding: token selection as pure functions, and the decoding loops."""

from moaspec.decoding.generation import GenerationConfig, GenerationResult
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.vanilla import generate

__all__ = ["GenerationConfig", "GenerationResult", "SamplingParams", "generate"]
