"""Prompt data: file loading (`load_prompts`) and resumable batch sources."""

from unirl.data.data_source import (
    DEFAULT_PROMPTS,
    DefaultDataSource,
    ListDataSource,
    PromptDataSource,
    SampledDemonstrations,
)
from unirl.data.datasets import SUPPORTED_EXTENSIONS, PromptFileError, load_prompts

__all__ = [
    "DEFAULT_PROMPTS",
    "SUPPORTED_EXTENSIONS",
    "DefaultDataSource",
    "ListDataSource",
    "PromptDataSource",
    "PromptFileError",
    "SampledDemonstrations",
    "load_prompts",
]
